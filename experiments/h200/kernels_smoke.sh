# Issue 4 smoke test: compiled kernels vs references on the GPU, then one benchmark point.
set -u
. experiments/h200/setup.sh >/dev/null
timeout 100 python3 -m pytest -q -x tests/test_kernels.py -p no:cacheprovider 2>&1 | tail -6
timeout 100 python3 -m experiments.run bench-attention --shapes qwen2.5-7b --contexts 32768 --batches 16 \
  --budgets 512 --iters 20 --repeats 5 --copy-gib 2 --out $OUT/bench_attention_smoke_h200.json 2>&1 | tail -9

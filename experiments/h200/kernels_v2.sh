# Issue 4, session 2: kernel tests compiled on the GPU, the variant exploration (7B layer, 32k, b16,
# k 512), then the full bench-attention sweep for $1 (resumable: a partial result copied to
# experiments/results/bench_attention_SHAPE_h200.json is continued by the next call).
set -u
. experiments/h200/setup.sh >/dev/null
shape=${1:-qwen2.5-7b}
budget_s=${2:-560}
start=$(date +%s)
if [ ! -f experiments/results/kernel_explore_h200.json ]; then
  python3 -m pytest -q -x tests/test_kernels.py 2>&1 | tail -3
  timeout 200 python3 -m experiments.kernel_explore --shapes qwen2.5-7b --out $OUT/kernel_explore_h200.json 2>&1 | grep -v "^ \|^{" | tail -40
fi
for s in $shape; do
  left=$(( budget_s - ($(date +%s) - start) ))
  [ $left -lt 40 ] && break
  cap=${CAP_FIRST:-$left}; [ $cap -lt $left ] && left=$cap; unset CAP_FIRST  # optional cap for the first shape
  # resume from the committed partial result of an earlier call
  [ -f experiments/results/bench_attention_${s}_h200.json ] && cp experiments/results/bench_attention_${s}_h200.json $OUT/bench_attention_$s.json
  extra=""  # the 72B sweep (second session call) times fewer variants, chosen from the 7B sweep
  [ $s = qwen2.5-72b ] && extra="--sparse-configs 64x1x4,64x2x4,32x4x4 --scoring-configs 256x8 --topk-configs 8xscatter,4xcompare"
  timeout $left python3 -m experiments.run bench-attention --shapes $s --contexts 32768,16384,8192 --batches 16,8,1 \
    --budgets 512,256,1024,2048 --iters 10 $extra --out $OUT/bench_attention_$s.json 2>&1 | grep -v "^ \|^{" | tail -5
done
ls -la $OUT

# Run 3 of the foundation issue: 7B-shape parity (float32 vs transformers on the GPU), skip-mask cost.
set -u
. experiments/h200/setup.sh
timeout 300 python3 -m experiments.run parity --model random:qwen2.5-7b-shape --prompt-tokens 64 \
  --out $OUT/parity_random_7b_h200.json 2>&1 | grep -v -i warn | tail -6
timeout 200 python3 -m experiments.run bench-skip --shape qwen2.5-7b-shape --context 8192 --batch 16 --steps 1 \
  --out $OUT/bench_skip_7b_h200.json 2>&1 | tail -10

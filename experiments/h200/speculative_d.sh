# Issue 3: the 7B/0.5B shapes at batch 8 and 16 (fixed acceptance, tau from the SmolLM2 self-draft run),
# with the draft/verify/other split from the donating per-phase profiler.
set -u
. experiments/h200/setup.sh
timeout 570 python3 -m experiments.run bench-sd --target-shape qwen2.5-7b-shape --draft-shape qwen2.5-0.5b-shape \
  --contexts 32768,16384,8192 --batches 16,8 --gamma 4 --tau-from experiments/results/sd_smollm2_selfdraft_b16_h200.json \
  --new-tokens 64 --repeats 3 --profile --out $OUT/bench_sd_7b_h200.json 2>&1 | tail -9

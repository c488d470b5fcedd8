# Issue 3: re-measure the draft/verify/other split at 32k with the commit phase donating its caches.
set -u
. experiments/h200/setup.sh
timeout 400 python3 -m experiments.run bench-sd --target-shape qwen2.5-7b-shape --draft-shape qwen2.5-0.5b-shape \
  --contexts 32768 --batches 16,8 --gamma 4 --tau-from experiments/results/sd_smollm2_selfdraft_b16_h200.json \
  --new-tokens 64 --repeats 3 --profile --out $OUT/bench_sd_7b_32k_profile_h200.json 2>&1 | tail -5

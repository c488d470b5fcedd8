# Issue 3/4: bench-sd with the Pallas attention backend (compare with bench_sd_7b_h200.json, XLA backend).
set -u
. experiments/h200/setup.sh >/dev/null
timeout 570 python3 -m experiments.run bench-sd --target-shape qwen2.5-7b-shape --draft-shape qwen2.5-0.5b-shape \
  --contexts 32768,8192 --batches 16 --gamma 4 --tau-from experiments/results/sd_smollm2_selfdraft_b16_h200.json \
  --new-tokens 64 --repeats 3 --profile --attention-backend pallas --out $OUT/bench_sd_7b_pallas_h200.json 2>&1 | tail -6

# Issue 3, run 3 of 3: the 7B/0.5B shapes at batch 16, tau from run 2's SmolLM2 JSON.
set -u
. experiments/h200/setup.sh
tau_file=experiments/results/sd_smollm2_selfdraft_b16_h200.json
[ -f /tmp/jaxspec_stage/sd_smollm2_selfdraft_b16_h200.json ] && tau_file=/tmp/jaxspec_stage/sd_smollm2_selfdraft_b16_h200.json
timeout 560 python3 -m experiments.run bench-sd --target-shape qwen2.5-7b-shape --draft-shape qwen2.5-0.5b-shape \
  --contexts 8192,16384,32768 --batches 16 --gamma 4 --tau-from $tau_file \
  --new-tokens 64 --repeats 3 --profile --out $OUT/bench_sd_7b_b16_h200.json 2>&1 | tail -6

# Session 5, the 32k counterpart of s5d.sh (run inline as one command in the last device minute):
. experiments/h200/setup.sh >/dev/null; W=$OUT/s5e; mkdir -p $W/profiles
cp experiments/results/knapspec_h200/profiles/*_forward.json $W/profiles/
timeout 130 python3 -m experiments.run knapspec --dtype bfloat16 --max-new-tokens 256 --candidate-plans 0 \
  --plan-cost-repeats 0 --latency-fit forward --device-tag h200 --profile-dir $W/profiles \
  --model random:qwen2.5-7b-shape --contexts 32768 --batches 1 --methods knapspec --gamma-buckets '' \
  --max-reference-tokens 16 --out $W/knapspec_7b_b1_32k_s5e_h200.json > $W/knapspec.log 2>&1
cd $OUT && tar czf s5e.tgz s5e && rm -rf s5e

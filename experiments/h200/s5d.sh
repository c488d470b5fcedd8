# Session 5, the last ~4 device minutes: does one dispatch per plain-decoding stretch (instead of one per
# 64 steps) remove the ~5 % KnapSpec lost to AR in plain-decoding mode on the 7B shape (b1, 8k, 256 tokens:
# no affordable plan, so KnapSpec decodes plainly after 0 plans)?
#   bash experiments/h200/s5d.sh SECONDS     (carry .carry/commit, .whl)
set -u
budget=${1:-180}
. experiments/h200/setup.sh >/dev/null
. experiments/h200/budget.sh
R=experiments/results/knapspec_h200; W=$OUT/s5d; mkdir -p $W/profiles
cp $R/profiles/*_forward.json $W/profiles/ 2>/dev/null
step 600 python3 -m experiments.run knapspec --dtype bfloat16 --max-new-tokens 256 --candidate-plans 0 \
  --plan-cost-repeats 0 --latency-fit forward --device-tag h200 --profile-dir $W/profiles \
  --model random:qwen2.5-7b-shape --contexts 8192 --batches 1 --methods knapspec \
  --gamma-buckets '' --max-reference-tokens 16 --out $W/knapspec_7b_b1_s5d_h200.json > $W/knapspec.log 2>&1
grep -v "^ \|^{\|it/s\]" $W/knapspec.log | tail -6
cd $OUT && tar czf s5d.tgz s5d && rm -rf s5d && ls -la $OUT

# Session 5, last call (one nvidia-h200): the 7B shape at batch 1, 8k and 32k, with the fixes made after
# next_session.sh ran (the arbitration's plain-decoding rate is the better of probe and latency model;
# the planning allowance keeps a 25 % margin; the DP window is never wider than the allowance).
#   bash experiments/h200/s5b.sh SECONDS     (carry .carry/commit, .whl)
set -u
budget=${1:-540}
. experiments/h200/setup.sh >/dev/null
. experiments/h200/budget.sh
R=experiments/results/knapspec_h200; W=$OUT/s5b; mkdir -p $W/profiles
cp $R/profiles/*_forward.json $W/profiles/ 2>/dev/null
step 600 python3 -m experiments.run knapspec --dtype bfloat16 --max-new-tokens 256 --candidate-plans 0 \
  --plan-cost-repeats 1 --latency-fit forward --device-tag h200 --profile-dir $W/profiles \
  --model random:qwen2.5-7b-shape --contexts 8192,32768 --batches 1 --methods knapspec,clasp,knapspec-official \
  --gamma-buckets '' --max-reference-tokens 16 --out $W/knapspec_7b_b1_s5b_h200.json > $W/knapspec_7b_b1.log 2>&1
grep -v "^ \|^{\|it/s\]" $W/knapspec_7b_b1.log | tail -14
cd $OUT && tar czf s5b.tgz s5b && rm -rf s5b && ls -la $OUT

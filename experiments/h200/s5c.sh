# Session 5, the last device minutes: the 7B shape at batch 1, 8k, with 1024 new tokens -- a run long
# enough that the planning allowance admits a DP, so the plan and the measured arbitration act on the GPU.
#   bash experiments/h200/s5c.sh SECONDS     (carry .carry/commit, .whl)
set -u
budget=${1:-300}
. experiments/h200/setup.sh >/dev/null
. experiments/h200/budget.sh
R=experiments/results/knapspec_h200; W=$OUT/s5c; mkdir -p $W/profiles
cp $R/profiles/*_forward.json $W/profiles/ 2>/dev/null
step 600 python3 -m experiments.run knapspec --dtype bfloat16 --max-new-tokens 1024 --candidate-plans 0 \
  --plan-cost-repeats 0 --latency-fit forward --device-tag h200 --profile-dir $W/profiles \
  --model random:qwen2.5-7b-shape --contexts 8192 --batches 1 --methods knapspec,clasp,knapspec-official \
  --gamma-buckets '' --max-reference-tokens 16 --out $W/knapspec_7b_b1_1024new_s5c_h200.json > $W/knapspec.log 2>&1
grep -v "^ \|^{\|it/s\]" $W/knapspec.log | tail -12
cd $OUT && tar czf s5c.tgz s5c && rm -rf s5c && ls -la $OUT

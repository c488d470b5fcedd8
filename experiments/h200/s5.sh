# Session 5 on one nvidia-h200, after next_session.sh (carry .carry/commit, .whl):
#   bash experiments/h200/s5.sh b SECONDS  -- the 7B shape b1 8k/32k after the arbitration / allowance fixes
#                                            (the arbitration's AR rate = max(probe, latency model); a 25 % margin
#                                            in the allowance; the DP window never wider than the allowance)
#   bash experiments/h200/s5.sh c SECONDS  -- 8k with 1024 new tokens: long enough that the allowance admits a DP,
#                                            so the plan and the arbitration act on the GPU
#   bash experiments/h200/s5.sh d SECONDS  -- KnapSpec alone at 8k after one dispatch per plain-decoding stretch
#   bash experiments/h200/s5.sh e SECONDS  -- the same at 32k
set -u
case_=$1; budget=${2:-300}
. experiments/h200/setup.sh >/dev/null
. experiments/h200/budget.sh
R=experiments/results/knapspec_h200; W=$OUT/s5$case_; mkdir -p $W/profiles
cp $R/profiles/*_forward.json $W/profiles/ 2>/dev/null
KS="python3 -m experiments.run knapspec --dtype bfloat16 --candidate-plans 0 --latency-fit forward --device-tag h200
    --profile-dir $W/profiles --model random:qwen2.5-7b-shape --batches 1 --gamma-buckets= --max-reference-tokens 16"
case $case_ in
  b) step 600 $KS --max-new-tokens 256 --plan-cost-repeats 1 --contexts 8192,32768 \
       --methods knapspec,clasp,knapspec-official --out $W/knapspec_7b_b1_s5b_h200.json > $W/knapspec.log 2>&1 ;;
  c) step 600 $KS --max-new-tokens 1024 --plan-cost-repeats 0 --contexts 8192 \
       --methods knapspec,clasp,knapspec-official --out $W/knapspec_7b_b1_1024new_s5c_h200.json > $W/knapspec.log 2>&1 ;;
  d) step 600 $KS --max-new-tokens 256 --plan-cost-repeats 0 --contexts 8192 --methods knapspec \
       --out $W/knapspec_7b_b1_s5d_h200.json > $W/knapspec.log 2>&1 ;;
  e) step 130 $KS --max-new-tokens 256 --plan-cost-repeats 0 --contexts 32768 --methods knapspec \
       --out $W/knapspec_7b_b1_32k_s5e_h200.json > $W/knapspec.log 2>&1 ;;
esac
grep -v "^ \|^{\|it/s\]" $W/knapspec.log | tail -14
cd $OUT && tar czf s5$case_.tgz s5$case_ && rm -rf s5$case_ && ls -la $OUT

# What session 4 left for the GPU (issue 6), for one nvidia-h200, two back-to-back calls
# (the machine keeps /tmp and ~/.cache for ~30 s between calls):
#   bash experiments/h200/next_session.sh smol SECONDS   # call 1 (carry .carry/smol.part.aa): stage the GGUF half,
#                                                         # the 7B shape at batch 1 (8k, 32k) and batch 16 (8k)
#   bash experiments/h200/next_session.sh rest SECONDS   # call 2 (carry .carry/smol.part.ab): SmolLM2 1k/4k/7.7k b1
# KnapSpec with the forward latency fit, the planning budget (5 %), the early-exit-aware TPT, and
# (session 5) the measured arbitration (--probe-rounds 8) and the planning allowance; new result files (the config gained max_plan_fraction, so session 4's files
# do not resume). Every step's timeout is cut to SECONDS; results packed into $OUT/s5.tgz.
set -u
part=$1; budget=${2:-540}
. experiments/h200/setup.sh >/dev/null
. experiments/h200/budget.sh
stage_smollm2
R=experiments/results/knapspec_h200; W=$OUT/s5; mkdir -p $W/profiles
cp $R/profiles/*_forward.json $W/profiles/ 2>/dev/null
for f in knapspec_7b_b1_s5_h200.json knapspec_7b_b16_s5_h200.json knapspec_smollm2_s5_h200.json; do [ -f $R/$f ] && cp $R/$f $W/$f; done
KS="python3 -m experiments.run knapspec --dtype bfloat16 --max-new-tokens 256 --candidate-plans 0 --plan-cost-repeats 1 --latency-fit forward --device-tag h200 --profile-dir $W/profiles"
case $part in
  smol)
    step 200 $KS --model random:qwen2.5-7b-shape --contexts 8192,32768 --batches 1 --methods knapspec,clasp,knapspec-official \
      --gamma-buckets '' --max-reference-tokens 16 --out $W/knapspec_7b_b1_s5_h200.json > $W/knapspec_7b_b1.log 2>&1
    step 300 $KS --model random:qwen2.5-7b-shape --contexts 8192 --batches 16 --methods knapspec,clasp \
      --gamma-buckets '' --max-reference-tokens 16 --out $W/knapspec_7b_b16_s5_h200.json > $W/knapspec_7b_b16.log 2>&1 ;;
  rest)
    [ -f $gguf ] && step 500 $KS --model smollm2-135m --contexts 1024,4096,7680 --batches 1 --methods knapspec,clasp,knapspec-official \
      --out $W/knapspec_smollm2_s5_h200.json > $W/knapspec_smol.log 2>&1 ;;
esac
for f in $W/*.log; do echo "== $f"; grep -v "^ \|^{\|it/s\]" $f | tail -12; done
cd $OUT && tar czf s5.tgz s5 && rm -rf s5 && ls -la $OUT

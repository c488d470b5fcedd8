# Session 4, call 4 (one nvidia-h200, cold start): where the time goes, with jax.profiler traces
# (experiments/trace.py): dustin-speed at 32k/b16 (AR, MagicDec, Dustin; Qwen pair's tau) and
# KnapSpec on the 7B shape at 8k/b1 (the latency profile from s4.sh reused). Results in $OUT/s4t.tgz.
#   bash experiments/h200/s4_trace.sh SECONDS
set -u
budget=${1:-330}
. experiments/h200/setup.sh >/dev/null
. experiments/h200/budget.sh  # (ran with 20 s kept for packing; budget.sh keeps 25)
R=experiments/results; W=$OUT/s4t; mkdir -p $W
step 190 python3 -m experiments.run dustin-speed --contexts 32768 --batches 16 --budget 512 --methods ar,magicdec,dustin \
  --trace --tau-from $R/sd_qwen_coder_pair_tau_cpu.json --out $W/dustin_speed_7b_trace_h200.json > $W/dustin_trace.log 2>&1
step 150 python3 -m experiments.run knapspec --model random:qwen2.5-7b-shape --dtype bfloat16 --contexts 8192 --batches 1 \
  --max-new-tokens 256 --methods knapspec --candidate-plans 0 --plan-cost-repeats 0 --gamma-buckets '' \
  --max-reference-tokens 16 --latency-fit forward --device-tag h200 --profile-dir $R/knapspec_h200/profiles --trace \
  --out $W/knapspec_7b_trace_h200.json > $W/knapspec_trace.log 2>&1
for f in $W/*.log; do echo "== $f"; grep -v "^{\|it/s\]" $f | grep -v "^ \{20\}" | tail -40; done
cd $OUT && tar czf s4t.tgz s4t && rm -rf s4t && ls -la $OUT

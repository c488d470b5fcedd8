# Session 4 on ONE nvidia-h200 (the two-GPU kind was not lent): next_session.sh's two streams,
# split into three back-to-back calls (the machine keeps /tmp and ~/.cache for ~30 s between calls).
#   bash experiments/h200/s4.sh dustin16 SECONDS  # call 1: stage GGUF half 1; dustin-speed b16 at 32k/16k/8k
#   bash experiments/h200/s4.sh dustin8 SECONDS   # call 2: reassemble the GGUF; dustin-speed b8 (resumed file)
#   bash experiments/h200/s4.sh knapspec SECONDS  # call 3: KnapSpec forward-fit runs, bench-skip
# SECONDS: the time this call may use; every step's timeout is cut to what is left, so the results are
# always packed into $OUT/s4.tgz (only ~8 files come back from a call). Resumable: copy the returned
# files into experiments/results/ (same relative paths) before the next call.
set -u
part=$1; budget=${2:-540}
. experiments/h200/setup.sh >/dev/null
. experiments/h200/budget.sh
stage_smollm2
R=experiments/results; W=$OUT/s4; mkdir -p $W/knapspec_h200/profiles
for f in dustin_speed_7b_qwen_tau_h200.json dustin_speed_7b_qwen_tau_b8_h200.json knapspec_h200/knapspec_smollm2_forward_h200.json knapspec_h200/knapspec_7b_b1_forward_h200.json; do
  [ -f $R/$f ] && cp $R/$f $W/$f
done
TAU="--tau-from $R/sd_qwen_coder_pair_tau_cpu.json"
DS="python3 -m experiments.run dustin-speed --contexts 32768,16384,8192 --budget 512 --profile $TAU "
case $part in
  dustin16) step 600 $DS --batches 16 --out $W/dustin_speed_7b_qwen_tau_h200.json > $W/dustin_speed_b16.log 2>&1 ;;
  dustin8)  step 600 $DS --batches 8 --out $W/dustin_speed_7b_qwen_tau_b8_h200.json > $W/dustin_speed_b8.log 2>&1 ;;
  knapspec)
    KS="python3 -m experiments.run knapspec --dtype bfloat16 --max-new-tokens 256 --candidate-plans 0 --plan-cost-repeats 1 --latency-fit forward --device-tag h200 --profile-dir $W/knapspec_h200/profiles"
    [ -f $gguf ] && step 210 $KS --model smollm2-135m --contexts 1024,4096,7680 --batches 1 --methods knapspec,clasp,knapspec-official \
      --out $W/knapspec_h200/knapspec_smollm2_forward_h200.json > $W/knapspec_smol.log 2>&1
    step 220 $KS --model random:qwen2.5-7b-shape --contexts 8192,32768 --batches 1 --methods knapspec,knapspec-official \
      --gamma-buckets '' --max-reference-tokens 16 --out $W/knapspec_h200/knapspec_7b_b1_forward_h200.json > $W/knapspec_7b.log 2>&1
    ( export XLA_FLAGS=--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE; step 80 python3 -m experiments.run bench-skip \
      --out $W/bench_skip_cmdbuf_h200.json > $W/skip_cmdbuf.log 2>&1 ) ;;
esac
for f in $W/*.log; do echo "== $f"; grep -v "^ \|^{\|it/s\]" $f | tail -12; done
cd $OUT && tar czf s4.tgz s4 && rm -rf s4 && ls -la $OUT

# What session 3 left for the GPU (issues 5, 6). Two single-GPU streams on nvidia-h200-x2
# (on nvidia-h200 run the two halves one after the other). Resumable: run it again in the next
# call and every results file continues where it stopped (copy the returned files into
# experiments/results/ first). Only ~8 files come back from a call, so everything is packed into
# $OUT/s4.tgz at the end: keep the inner timeouts below the call's limit (~490 s here; call with timeout_s 570).
# GGUF for SmolLM2: see README.md here (two halves on back-to-back calls).
set -u
. experiments/h200/setup.sh >/dev/null
gguf=~/.cache/jaxspec/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f $gguf ] || { [ -f /tmp/jaxspec_stage/smol.part.aa ] && [ -f .carry/smol.part.ab ] && cat /tmp/jaxspec_stage/smol.part.aa .carry/smol.part.ab > $gguf; }
[ -f .carry/smol.part.aa ] && cp .carry/smol.part.aa /tmp/jaxspec_stage/
R=experiments/results; W=$OUT/s4; mkdir -p $W/knapspec_h200/profiles
for f in dustin_speed_7b_qwen_tau_h200.json knapspec_h200/knapspec_smollm2_forward_h200.json knapspec_h200/knapspec_7b_b1_forward_h200.json; do
  [ -f $R/$f ] && cp $R/$f $W/$f
done
TAU="--tau-from $R/sd_qwen_coder_pair_tau_cpu.json"
(
  export CUDA_VISIBLE_DEVICES=0
  # issue 5 item 8: every point with the Qwen pair's tau and the per-round split
  timeout 400 python3 -m experiments.run dustin-speed --contexts 32768,16384,8192 --batches 16,8 --budget 512 \
    --profile $TAU --out $W/dustin_speed_7b_qwen_tau_h200.json > $W/dustin_speed.log 2>&1
  # the dynamic skip mask's conditionals with XLA's defaults (GPU 1 runs the same with device-side conditionals)
  timeout 80 python3 -m experiments.run bench-skip --out $W/bench_skip_default_h200.json > $W/skip_default.log 2>&1
) &
(
  export CUDA_VISIBLE_DEVICES=1
  # issue 6: does the whole-forward fit (with the target-forward ratio a) make KnapSpec stop drafting where it does not pay?
  [ -f $gguf ] && timeout 200 python3 -m experiments.run knapspec --model smollm2-135m --dtype bfloat16 \
    --contexts 1024,4096,7680 --batches 1 --max-new-tokens 256 --methods knapspec,clasp,knapspec-official \
    --candidate-plans 0 --plan-cost-repeats 1 --latency-fit forward --device-tag h200 \
    --profile-dir $W/knapspec_h200/profiles --out $W/knapspec_h200/knapspec_smollm2_forward_h200.json > $W/knapspec_smol.log 2>&1
  timeout 200 python3 -m experiments.run knapspec --model random:qwen2.5-7b-shape --dtype bfloat16 \
    --contexts 8192,32768 --batches 1 --max-new-tokens 256 --methods knapspec,knapspec-official --candidate-plans 0 \
    --plan-cost-repeats 1 --gamma-buckets '' --max-reference-tokens 16 --latency-fit forward --device-tag h200 \
    --profile-dir $W/knapspec_h200/profiles --out $W/knapspec_h200/knapspec_7b_b1_forward_h200.json > $W/knapspec_7b.log 2>&1
  # device-side conditionals (CUDA-graph command buffers) for the skip mask
  XLA_FLAGS=--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE timeout 80 python3 -m experiments.run bench-skip \
    --out $W/bench_skip_cmdbuf_h200.json > $W/skip_cmdbuf.log 2>&1
) &
wait
for f in $W/*.log; do echo "== $f"; grep -v "^ \|^{\|it/s\]" $f | tail -8; done
cd $OUT && tar czf s4.tgz s4 && rm -rf s4 && ls -la $OUT

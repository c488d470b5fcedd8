# Session 3, call 1 (nvidia-h200-x2, two independent single-GPU streams, ~9.5 min):
# GPU 0: the two missing bench-attention cells (batch 1 at 8k; resumed from the committed files),
#        kernel_explore (one-launch fused sparse attention, one-kernel Pallas top-k), then
#        knapspec on the 7B shape at batch 16 (8k, 16k).
# GPU 1: dustin-speed at the remaining points (7B shape: 32k b8, 16k/8k b16/b8; 32k b16 again),
#        then knapspec on the 7B shape at batch 1 (8k, 32k, 16k).
# Also stages the first half of SmolLM2's GGUF in /tmp/jaxspec_stage for the next call.
set -u
. experiments/h200/setup.sh >/dev/null
cp .carry/smol.part.aa /tmp/jaxspec_stage/ 2>/dev/null || true
red="--sparse-configs 64x1x4,64x2x4,32x4x4 --scoring-configs 256x8 --topk-configs 8xscatter,4xcompare"
mkdir -p $OUT/knapspec_h200/profiles
cp experiments/results/bench_attention_qwen2.5-72b_h200.json $OUT/bench_attention_qwen2.5-72b.json
cp experiments/results/bench_attention_qwen2.5-7b_8k_h200.json $OUT/bench_attention_qwen2.5-7b_8k.json
for f in knapspec_7b_b1_h200.json knapspec_7b_b16_h200.json; do
  [ -f experiments/results/knapspec_h200/$f ] && cp experiments/results/knapspec_h200/$f $OUT/knapspec_h200/
done
KS="python3 -m experiments.run knapspec --model random:qwen2.5-7b-shape --dtype bfloat16 --max-new-tokens 256 --plan-cost-repeats 1 --gamma-buckets '' --max-reference-tokens 16 --device-tag h200 --profile-dir $OUT/knapspec_h200/profiles"
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 100 python3 -m experiments.run bench-attention --shapes qwen2.5-72b --contexts 32768,16384,8192 \
    --batches 16,8,1 --budgets 512,256,1024,2048 --iters 10 $red --out $OUT/bench_attention_qwen2.5-72b.json 2>&1 | tail -3
  timeout 90 python3 -m experiments.run bench-attention --shapes qwen2.5-7b --contexts 8192 \
    --batches 16,8,1 --budgets 512,256,1024,2048 --iters 10 $red --out $OUT/bench_attention_qwen2.5-7b_8k.json 2>&1 | tail -3
  timeout 110 python3 -m experiments.kernel_explore --shapes qwen2.5-7b --out $OUT/kernel_explore_s3_h200.json > $OUT/kernel_explore.log 2>&1
  tail -25 $OUT/kernel_explore.log
  eval timeout 240 $KS --contexts 8192,16384 --batches 16 --methods knapspec,clasp --candidate-plans 0 \
    --out $OUT/knapspec_h200/knapspec_7b_b16_h200.json > $OUT/knapspec_b16.log 2>&1
  grep "^\[\|latency\|Error\|error" $OUT/knapspec_b16.log | tail -12
) > $OUT/gpu0.log 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 300 python3 -m experiments.run dustin-speed --contexts 32768,16384,8192 --batches 8,16 --budget 512 \
    --tau-from experiments/results/sd_smollm2_selfdraft_b16_h200.json --out $OUT/dustin_speed_7b_more_h200.json > $OUT/dustin_speed.log 2>&1
  grep -v "^ \|^{" $OUT/dustin_speed.log | tail -14
  eval timeout 245 $KS --contexts 8192,32768,16384 --batches 1 --methods knapspec,clasp,knapspec-official --candidate-plans 0 \
    --out $OUT/knapspec_h200/knapspec_7b_b1_h200.json > $OUT/knapspec_b1.log 2>&1
  grep "^\[\|latency\|Error\|error" $OUT/knapspec_b1.log | tail -12
) > $OUT/gpu1.log 2>&1 &
wait
echo "== GPU 0"; cat $OUT/gpu0.log; echo "== GPU 1"; cat $OUT/gpu1.log
ls -la $OUT $OUT/knapspec_h200
cp -r $OUT/knapspec_h200 /tmp/jaxspec_stage/ 2>/dev/null || true   # call 2 resumes these

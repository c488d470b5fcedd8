# What session 2 could not run for lack of device time (one call, ~9 min):
# 1. the two missing bench-attention cells (batch 1 at 8k, both shapes; resumed from the committed files),
# 2. the one-kernel Pallas radix top-k and the other variants at 7B/32k/b16/k512 (new file),
# 3. dustin-speed at the remaining points (7B shape: 32k b8, 16k and 8k at b16/b8).
set -u
. experiments/h200/setup.sh >/dev/null
red="--sparse-configs 64x1x4,64x2x4,32x4x4 --scoring-configs 256x8 --topk-configs 8xscatter,4xcompare"
cp experiments/results/bench_attention_qwen2.5-72b_h200.json $OUT/bench_attention_qwen2.5-72b.json
cp experiments/results/bench_attention_qwen2.5-7b_8k_h200.json $OUT/bench_attention_qwen2.5-7b_8k.json
timeout 120 python3 -m experiments.run bench-attention --shapes qwen2.5-72b --contexts 32768,16384,8192 \
  --batches 16,8,1 --budgets 512,256,1024,2048 --iters 10 $red --out $OUT/bench_attention_qwen2.5-72b.json 2>&1 | tail -2
timeout 100 python3 -m experiments.run bench-attention --shapes qwen2.5-7b --contexts 8192 \
  --batches 16,8,1 --budgets 512,256,1024,2048 --iters 10 $red --out $OUT/bench_attention_qwen2.5-7b_8k.json 2>&1 | tail -2
timeout 120 python3 -m experiments.kernel_explore --shapes qwen2.5-7b --out $OUT/kernel_explore_s3_h200.json 2>&1 | grep topk
timeout 200 python3 -m experiments.run dustin-speed --contexts 32768,16384,8192 --batches 8,16 --budget 512 \
  --tau-from experiments/results/sd_smollm2_selfdraft_b16_h200.json --out $OUT/dustin_speed_7b_more_h200.json 2>&1 | grep -v "^ \|^{" | tail -12
ls -la $OUT

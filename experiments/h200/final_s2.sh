# Session 2's last call: dustin-speed at the headline point (7B shape, 32k, batch 16, k 512; issue 5)
# and what was left of the bench-attention sweep (issue 4): 72B remaining cases (resumed from the
# committed file), 7B at 8k with the reduced variant list (own file).
set -u
. experiments/h200/setup.sh >/dev/null
start=$(date +%s)
timeout 210 python3 -m experiments.run dustin-speed --contexts 32768 --batches 16 --budget 512 \
  --tau-from experiments/results/sd_smollm2_selfdraft_b16_h200.json --out $OUT/dustin_speed_7b_h200.json 2>&1 | grep -v "^ \|^{" | tail -8
left=$(( ${1:-520} - ($(date +%s) - start) ))
cp experiments/results/bench_attention_qwen2.5-72b_h200.json $OUT/bench_attention_qwen2.5-72b.json
red="--sparse-configs 64x1x4,64x2x4,32x4x4 --scoring-configs 256x8 --topk-configs 8xscatter,4xcompare"
timeout $(( left * 6 / 10 )) python3 -m experiments.run bench-attention --shapes qwen2.5-72b --contexts 32768,16384,8192 \
  --batches 16,8,1 --budgets 512,256,1024,2048 --iters 10 $red --out $OUT/bench_attention_qwen2.5-72b.json 2>&1 | grep -v "^ \|^{" | tail -3
left=$(( ${1:-520} - ($(date +%s) - start) ))
[ $left -gt 30 ] && timeout $left python3 -m experiments.run bench-attention --shapes qwen2.5-7b --contexts 8192 \
  --batches 16,8,1 --budgets 512,256,1024,2048 --iters 10 $red --out $OUT/bench_attention_qwen2.5-7b_8k.json 2>&1 | grep -v "^ \|^{" | tail -3
ls -la $OUT

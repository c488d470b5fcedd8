# Issue 8 (needs nvidia-h200-x4 or -x8; not run yet): Qwen2.5-72B-shaped target, tensor parallel over
# all GPUs of the host, Qwen2.5-0.5B-shaped draft replicated, 32k context, batch 16, k 512, fixed
# acceptance; AR / ClassicSD / MagicDec / Dustin, attention dense vs sparse, all-reduce per step.
# Usage: bash experiments/h200/multi_gpu_72b.sh 4   (or 8)
set -u
. experiments/h200/setup.sh >/dev/null   # sets NCCL_NVLS_ENABLE=0 and the other multicast-off variables
tp=${1:-4}
nvidia-smi topo -m | head -12
timeout 560 python3 -m experiments.run dustin-speed --mesh data=1,tensor=$tp --target-shape qwen2.5-72b-shape \
  --draft-shape qwen2.5-0.5b-shape --contexts 32768 --batches 16 --budget 512 \
  --tau-from experiments/results/sd_smollm2_selfdraft_b16_h200.json \
  --out $OUT/dustin_speed_72b_tp$tp.json 2>&1 | grep -v "^ \|^{" | tail -12

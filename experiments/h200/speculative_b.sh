# Issue 3, run 2 of 3: SmolLM2 self-draft end to end (real weights; tau measured), then the 7B/0.5B
# shapes in fixed-acceptance mode at batch 8 with that tau.
set -u
. experiments/h200/setup.sh
gguf=~/.cache/jaxspec/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f /tmp/jaxspec_stage/smol.part.aa ] && [ -f .carry/smol.part.ab ]; then
  cat /tmp/jaxspec_stage/smol.part.aa .carry/smol.part.ab > $gguf
fi
timeout 200 python3 -m experiments.run generate --model smollm2-135m --prompt-file experiments/prompts/long_demo.txt \
  --batch 16 --max-new-tokens 256 --method sd --draft-skip "attn:8-12" --gamma 4 --compare-ar --profile \
  --out $OUT/sd_smollm2_selfdraft_b16_h200.json 2>&1 | tail -4
cp $OUT/sd_smollm2_selfdraft_b16_h200.json /tmp/jaxspec_stage/ 2>/dev/null
timeout 330 python3 -m experiments.run bench-sd --target-shape qwen2.5-7b-shape --draft-shape qwen2.5-0.5b-shape \
  --contexts 8192,16384,32768 --batches 8 --gamma 4 --tau-from $OUT/sd_smollm2_selfdraft_b16_h200.json \
  --new-tokens 64 --repeats 3 --profile --out $OUT/bench_sd_7b_b8_h200.json 2>&1 | tail -6

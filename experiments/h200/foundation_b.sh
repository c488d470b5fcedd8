# Run 2 of the foundation issue: SmolLM2 (GGUF reassembled from two carried halves) + 7B decode.
set -u
. experiments/h200/setup.sh
gguf=~/.cache/jaxspec/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f /tmp/jaxspec_stage/smol.part.aa ] && [ -f .carry/smol.part.ab ]; then
  cat /tmp/jaxspec_stage/smol.part.aa .carry/smol.part.ab > $gguf; ls -la $gguf
else
  echo "SmolLM2 halves missing: skipping the real-weights runs"
fi
R=experiments/results
python3 -c "print(open('experiments/prompts/long_demo.txt').read() * 9, end='')" > /tmp/long_prompt.txt
if [ -f $gguf ]; then
  timeout 150 python3 -m experiments.run parity --model smollm2-135m --out $OUT/parity_smollm2_h200.json 2>&1 | grep -v -i warn | tail -8
  timeout 150 python3 -m experiments.run generate --model smollm2-135m --prompt-file /tmp/long_prompt.txt --batch 16 \
    --max-new-tokens 256 --no-chat --out $OUT/generate_smollm2_b16_h200.json 2>&1 | tail -4
fi
timeout 240 python3 -m experiments.run bench-decode --shape qwen2.5-7b-shape --contexts 8192,32768 --batches 16 \
  --new-tokens 32 --repeats 5 --out $OUT/bench_decode_7b_h200.json 2>&1 | tail -6

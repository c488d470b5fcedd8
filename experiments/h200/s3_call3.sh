# Session 3, call 3 (nvidia-h200-x2): real SmolLM2 end to end (issue 5 item 8), after call 2's attempt
# ran out of time (100 s per run was too short; a parallel KnapSpec load raced on the converted-weights
# cache). Batch 16, 7.6k-token Persuasion prompt, 256 new tokens, self-draft mlp:10-12, gamma 4, k 512,
# AR in the same process for each. GPU 0: ClassicSD then Dustin (Pallas attention); GPU 1: MagicDec
# (Pallas) then Dustin (XLA attention). Needs the GGUF in /tmp/jaxspec_stage halves or the cache.
set -u
. experiments/h200/setup.sh >/dev/null
gguf=~/.cache/jaxspec/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f $gguf ] || cat /tmp/jaxspec_stage/smol.part.aa .carry/smol.part.ab > $gguf
mkdir -p $OUT/smollm2_e2e
python3 -c "from jaxspec.models.loading import load_model; load_model('smollm2-135m', dtype='bfloat16')" 2>&1 | tail -1
G="python3 -m experiments.run generate --model smollm2-135m --prompt-file experiments/prompts/persuasion_7600.txt --batch 16 --max-new-tokens 256 --gamma 4 --draft-skip mlp:10-12 --compare-ar"
D="--budget 512 --dustin-profile experiments/profiles/smollm2-135m_selfdraft_mlp10-12.json"
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 185 $G --method sd --attention-backend pallas --out $OUT/smollm2_e2e/classic_pallas.json > $OUT/smollm2_e2e/classic_pallas.log 2>&1
  timeout 185 $G --method dustin $D --attention-backend pallas --out $OUT/smollm2_e2e/dustin_pallas.json > $OUT/smollm2_e2e/dustin_pallas.log 2>&1
) &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 185 $G --method magicdec --budget 512 --attention-backend pallas --out $OUT/smollm2_e2e/magicdec_pallas.json > $OUT/smollm2_e2e/magicdec_pallas.log 2>&1
  timeout 185 $G --method dustin $D --attention-backend xla --out $OUT/smollm2_e2e/dustin_xla.json > $OUT/smollm2_e2e/dustin_xla.log 2>&1
) &
wait
for f in $OUT/smollm2_e2e/*.log; do echo "-- $f"; grep -v "^---\|^ \|^$\|warn" $f | tail -5; done

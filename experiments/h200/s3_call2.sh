# Session 3, call 2 (nvidia-h200-x2, right after call 1 so /tmp/jaxspec_stage survives):
# GPU 0: real SmolLM2-135M end to end (issue 5 item 8): batch 16, a 7.6k-token Persuasion prompt,
#        256 new tokens, self-draft mlp:10-12, gamma 4, k 512: ClassicSD, MagicDec, Dustin (profiled),
#        each with AR in the same process; Pallas attention, then XLA attention.
# GPU 1: KnapSpec on real SmolLM2 (issue 6), batch 1 and 16; then the 7B-shape batch-1 run resumed.
set -u
. experiments/h200/setup.sh >/dev/null
gguf=~/.cache/jaxspec/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/jaxspec_stage/smol.part.aa .carry/smol.part.ab > $gguf && ls -la $gguf
export JAXSPEC_AUSTEN_SOURCE=$PWD/.carry/austen
mkdir -p $OUT/smollm2_e2e $OUT/knapspec_h200/profiles
cp -r /tmp/jaxspec_stage/knapspec_h200/* $OUT/knapspec_h200/ 2>/dev/null || true
KS="python3 -m experiments.run knapspec --model random:qwen2.5-7b-shape --dtype bfloat16 --max-new-tokens 256 --plan-cost-repeats 1 --gamma-buckets '' --max-reference-tokens 16 --device-tag h200 --profile-dir $OUT/knapspec_h200/profiles"
G="python3 -m experiments.run generate --model smollm2-135m --prompt-file experiments/prompts/persuasion_7600.txt --batch 16 --max-new-tokens 256 --gamma 4 --draft-skip mlp:10-12 --compare-ar --profile"
(
  export CUDA_VISIBLE_DEVICES=0
  for be in pallas xla; do
    timeout 100 $G --method sd --attention-backend $be --out $OUT/smollm2_e2e/classic_$be.json > $OUT/smollm2_e2e/classic_$be.log 2>&1
    timeout 100 $G --method magicdec --budget 512 --attention-backend $be --out $OUT/smollm2_e2e/magicdec_$be.json > $OUT/smollm2_e2e/magicdec_$be.log 2>&1
    timeout 100 $G --method dustin --budget 512 --dustin-profile experiments/profiles/smollm2-135m_selfdraft_mlp10-12.json \
      --attention-backend $be --out $OUT/smollm2_e2e/dustin_$be.json > $OUT/smollm2_e2e/dustin_$be.log 2>&1
    for f in $OUT/smollm2_e2e/*_$be.log; do echo "-- $f"; tail -4 $f; done
  done
) > $OUT/gpu0.log 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 330 python3 -m experiments.run knapspec --model smollm2-135m --dtype bfloat16 --contexts 1024,4096,7680 \
    --batches 1,16 --max-new-tokens 256 --methods knapspec,clasp,knapspec-official --candidate-plans 0 --plan-cost-repeats 1 \
    --device-tag h200 --profile-dir $OUT/knapspec_h200/profiles --out $OUT/knapspec_h200/knapspec_smollm2_h200.json \
    > $OUT/knapspec_smol.log 2>&1
  grep "^\[\|latency\|Error\|error" $OUT/knapspec_smol.log | tail -14
  eval timeout 220 $KS --contexts 8192,32768,16384 --batches 1 --methods knapspec,clasp,knapspec-official --candidate-plans 0 \
    --out $OUT/knapspec_h200/knapspec_7b_b1_h200.json > $OUT/knapspec_b1.log 2>&1
  grep "^\[\|latency\|Error\|error" $OUT/knapspec_b1.log | tail -12
) > $OUT/gpu1.log 2>&1 &
wait
echo "== GPU 0"; cat $OUT/gpu0.log; echo "== GPU 1"; cat $OUT/gpu1.log
cp -r $OUT/knapspec_h200 /tmp/jaxspec_stage/ 2>/dev/null || true
ls -la $OUT $OUT/*/

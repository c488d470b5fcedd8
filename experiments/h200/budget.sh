# Sourced by the session scripts after setting `budget` (seconds this call may use):
#   step CAP CMD...  runs CMD under `timeout min(CAP, what is left)`, or skips it when < 30 s are left
#                    so a call always keeps 25 s to pack its results (only ~8 files come back);
#   stage_smollm2    reassembles SmolLM2's GGUF from two back-to-back calls (.carry/smol.part.aa in the
#                    first, .carry/smol.part.ab in the second; /tmp survives ~30 s between calls) and
#                    points the corpus at the carried Austen texts.
start=$(date +%s)
left() { echo $(( budget - ($(date +%s) - start) - 25 )); }
step() { local cap=$1; shift; local t=$(left)
         [ $t -lt 30 ] && { echo "skip (only $t s left): $*"; return; }
         [ $t -gt $cap ] && t=$cap
         echo "== $(date +%T) timeout $t: $*"; timeout $t "$@"; echo "== rc $?"; }
gguf=~/.cache/jaxspec/SmolLM2-135M-Instruct.Q4_1.gguf
stage_smollm2() {
  [ -f .carry/smol.part.aa ] && cp .carry/smol.part.aa /tmp/jaxspec_stage/
  [ -f $gguf ] || { [ -f /tmp/jaxspec_stage/smol.part.aa ] && [ -f .carry/smol.part.ab ] \
    && cat /tmp/jaxspec_stage/smol.part.aa .carry/smol.part.ab > $gguf; }
  [ -d .carry/austen ] && export JAXSPEC_AUSTEN_SOURCE=$PWD/.carry/austen
  return 0
}

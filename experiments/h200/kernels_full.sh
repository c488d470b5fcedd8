# Issue 4: the full bench-attention sweep for one layer shape ($1 = qwen2.5-7b or qwen2.5-72b).
# Resumable: rerun with the same arguments continues where a previous run stopped.
set -u
. experiments/h200/setup.sh >/dev/null
shape=${1:-qwen2.5-7b}
mkdir -p /tmp/jaxspec_stage
[ -f /tmp/jaxspec_stage/bench_attention_$shape.json ] && cp /tmp/jaxspec_stage/bench_attention_$shape.json $OUT/
timeout 560 python3 -m experiments.run bench-attention --shapes $shape --contexts 8192,16384,32768 --batches 1,8,16 \
  --budgets 256,512,1024,2048 --out $OUT/bench_attention_$shape.json 2>&1 | tail -40
cp $OUT/bench_attention_$shape.json /tmp/jaxspec_stage/ 2>/dev/null

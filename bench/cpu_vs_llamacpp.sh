#!/bin/bash
# Alternates our engine_bench and llama.cpp's llama-bench /
# llama-batched-bench on llama2-110m shapes, same machine, same run.
#
#   bench/cpu_vs_llamacpp.sh LLAMA_BIN_DIR GGUF_DIR ROUNDS > log
#
# GGUF_DIR holds f32.gguf, F16.gguf, BF16.gguf and Q8_0.gguf of a model with
# llama2-110m's shapes (dim 768, ffn 2048, 12 layers, 12 heads, vocab
# 32000); see bench/results/cpu_weights.md for how they were made offline.
set -u
bin=$1 gguf=$2 rounds=${3:-2}
ours=bazel-bin/bench/engine_bench
for r in $(seq 1 "$rounds"); do
  echo "### round $r ours $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  "$ours" --models=synthetic:llama2-110m --lengths=512 --decode_tokens 128 \
    --reps 3 --weight_dtypes=f32,bf16,int8 --batch_sizes=1,16
  echo "### round $r llama.cpp $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  for q in f32 F16 BF16 Q8_0; do
    "$bin/llama-bench" -m "$gguf/$q.gguf" -t 2 -p 512 -n 128 -r 3 2>/dev/null |
      grep -E "pp512|tg128"
  done
  for q in f32 F16 BF16 Q8_0; do
    echo "batched $q"
    "$bin/llama-batched-bench" -m "$gguf/$q.gguf" -t 2 -c 8192 -b 2048 \
      -ub 512 -npp 128 -ntg 128 -npl 16 2>/dev/null | grep -E "^\|"
  done
done

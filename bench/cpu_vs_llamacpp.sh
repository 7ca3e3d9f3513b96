#!/bin/bash
# Alternates our engine_bench with llama.cpp's llama-bench and
# llama-batched-bench on llama2-110m shapes: same machine, same run.
#
#   bench/cpu_vs_llamacpp.sh LLAMA_BIN_DIR GGUF_DIR ROUNDS [BASE_ENGINE_BENCH]
#
# GGUF_DIR holds f32.gguf, F16.gguf, BF16.gguf and Q8_0.gguf of a model with
# llama2-110m's shapes (dim 768, ffn 2048, 12 layers, 12 heads, vocab
# 32000); bench/results/cpu_weights.md says how they were made offline.
# BASE_ENGINE_BENCH, if given, is another build of engine_bench (e.g. main
# before a change) run in f32 in the same rounds. Env: TG (decode tokens,
# default 128), BATCH_TG (batched decode steps, default 32).
set -u
bin=$1 gguf=$2 rounds=${3:-2} base=${4:-}
tg=${TG:-128} btg=${BATCH_TG:-32}
ours=bazel-bin/bench/engine_bench
load() { cut -d' ' -f1-3 /proc/loadavg; }
for r in $(seq 1 "$rounds"); do
  # Prefill at 512 tokens; decode from a 1-token prompt, as llama-bench's
  # tg test decodes from an empty context (a 512-token context would add
  # 38 MB of f32 KV reads to every step); batched decode at 128 cached
  # tokens per sequence, as llama-batched-bench -npp 128.
  echo "### round $r ours $(date +%T) load $(load)"
  "$ours" --models=synthetic:llama2-110m --lengths=512 --decode_tokens 1 \
    --reps 2 --weight_dtypes=f32,bf16,int8 --batch_model=
  "$ours" --models=synthetic:llama2-110m --lengths=1 --decode_tokens "$tg" \
    --reps 2 --weight_dtypes=f32,bf16,int8 --batch_sizes=1,16
  if [ -n "$base" ]; then
    echo "### round $r base $(date +%T) load $(load)"
    "$base" --models=synthetic:llama2-110m --lengths=512 --decode_tokens "$tg" \
      --reps 2 --batch_sizes=1,16
  fi
  echo "### round $r llama.cpp $(date +%T) load $(load)"
  for q in f32 F16 BF16 Q8_0; do
    "$bin/llama-bench" -m "$gguf/$q.gguf" -t 2 -p 512 -n "$tg" -r 2 \
      2>/dev/null | grep -E "pp512|tg$tg"
  done
  for q in F16 BF16 Q8_0; do
    echo "batched $q $(date +%T) load $(load)"
    "$bin/llama-batched-bench" -m "$gguf/$q.gguf" -t 2 -c 8192 -b 2048 \
      -ub 512 -npp 128 -ntg "$btg" -npl 16 2>/dev/null | grep -E "^\|  *[0-9]"
  done
done

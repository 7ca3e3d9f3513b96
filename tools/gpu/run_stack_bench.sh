#!/usr/bin/env bash
# Runs the bundled stack (tools/gpu/bundle_stack.sh) as three processes on
# one machine, speculator and target as separate processes on the one GPU
# and the router in front, and measures through the router: TTFT at each
# prompt length with Speculative Prefill at keep
# 0.1 and 0.3 and with full prefill, then decode tokens/s with speculative
# decoding on and off, then output tokens/s of 1 / 16 / 64 / 128
# concurrent streams through the router's OpenAI HTTP API (plain decode:
# tools/gpu/http_load.py), and, where PyTorch with CUDA is installed,
# transformers' static-batch `generate` on the same target as the anchor
# (bench/gpu/torch_bench.py --batch_sizes). Prints Markdown tables; exits
# non-zero if a service fails to start or a request fails.
#
#   tools/gpu/run_stack_bench.sh          (from the repository root)
# With the device tool:
#   run(command="tools/gpu/run_stack_bench.sh 2>&1 | tee $OUT/stack.log",
#       carry=[".device/stack"])
#
# Env: STACK (default .device/stack), DEVICE (cuda | cpu, default cuda),
# SPECULATOR / TARGET (model directories; default: synthetic
# llama-3.2-1b -> llama-3.1-8b in BF16, made under $SYN, default
# $CKPT_DIR or /tmp/specserve_gpu_ckpt as in run_gpu_bench.sh), LENGTHS
# (default "4096 8192 16384 32768"), REPS (default 3; the median is
# reported), NEW_TOKENS (default 64),
# SPECULATOR_GPU_UTIL / TARGET_GPU_UTIL (--gpu_memory_utilization of each,
# default 0.15 / 0.75), STREAMS (default "1 16 64 128"; empty skips the
# concurrency table), STREAM_PROMPT_TOKENS (default 256),
# STREAM_NEW_TOKENS (default 128), STREAM_REQUESTS (requests per stream,
# default 2), ANCHOR (auto | off, default auto: the transformers anchor
# runs when python3 imports torch with a CUDA device), SERVICE_ARGS (more
# flags for both model services, e.g. --nocuda_graphs to time eager steps),
# SPECULATOR_ARGS / TARGET_ARGS (more flags for one of them, e.g.
# --max_num_batched_tokens 2048),
# LOGS (folder for the services' logs and prompts; default a fresh temp
# folder), CHECKS (1, the default: tools/gpu/stack_checks.sh's lossless
# greedy checks of every drafting method after the decode table; 0 skips).
set -euo pipefail
cd "$(dirname "$0")/../.."
STACK=${STACK:-.device/stack}
DEVICE=${DEVICE:-cuda}
LENGTHS=${LENGTHS:-"4096 8192 16384 32768"}
REPS=${REPS:-3}
NEW_TOKENS=${NEW_TOKENS:-64}
# The same folder run_gpu_bench.sh writes them to: a device session makes
# the 16 GB of checkpoints once.
SYN=${SYN:-${CKPT_DIR:-/tmp/specserve_gpu_ckpt}}
export LD_LIBRARY_PATH="$STACK/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if [ "$DEVICE" = cuda ]; then
  # shellcheck source=tools/gpu/gpu_env.sh
  source tools/gpu/gpu_env.sh
fi
for b in router speculator_service target_service client \
         make_synthetic_checkpoint; do
  if [ ! -x "$STACK/bin/$b" ]; then
    echo "run_stack_bench: $STACK/bin/$b missing: run" \
         "tools/gpu/bundle_stack.sh and carry $STACK" >&2
    exit 3
  fi
done
if [ -z "${SPECULATOR:-}" ] || [ -z "${TARGET:-}" ]; then
  for p in llama-3.2-1b llama-3.1-8b; do
    # config.json is written last: its presence means the write finished.
    if [ ! -s "$SYN/$p/model.safetensors" ] || [ ! -s "$SYN/$p/config.json" ]; then
      "$STACK/bin/make_synthetic_checkpoint" --preset "$p" --dtype BF16 \
        --out "$SYN/$p"
    fi
  done
  SPECULATOR=${SPECULATOR:-$SYN/llama-3.2-1b}
  TARGET=${TARGET:-$SYN/llama-3.1-8b}
fi

LOGS=${LOGS:-$(mktemp -d)}
mkdir -p "$LOGS"
# start() runs in a command substitution (a subshell), so the PIDs go to
# files that the EXIT trap reads.
cleanup() {
  local f
  for f in "$LOGS"/*.pid; do
    [ -e "$f" ] && kill "$(cat "$f")" 2>/dev/null || true
  done
}
trap cleanup EXIT

# launch NAME ARGS...: runs $STACK/bin/NAME in the background, its log in
# $LOGS/NAME.log. port NAME: echoes its gRPC port once it prints
# "listening on <port>" (600 s for weights to load). start = both.
launch() {
  local name=$1
  shift
  : > "$LOGS/$name.log"
  "$STACK/bin/$name" "$@" > "$LOGS/$name.log" 2>&1 &
  echo "$!" > "$LOGS/$name.pid"
}
port() {
  local name=$1 pid i
  pid=$(cat "$LOGS/$name.pid")
  for ((i = 0; i < 6000; ++i)); do
    if grep -q "listening on" "$LOGS/$name.log"; then
      sed -n 's/.*listening on \([0-9]*\).*/\1/p' "$LOGS/$name.log" | head -1
      return 0
    fi
    if ! kill -0 "$pid" 2>/dev/null; then break; fi
    sleep 0.1
  done
  echo "run_stack_bench: $name did not start:" >&2
  cat "$LOGS/$name.log" >&2
  return 1
}
start() {
  launch "$@"
  port "$1"
}

# Both services share the one GPU: their --gpu_memory_utilization shares
# (vLLM's meaning, each sizes its KV pool from its own) must sum to < 1.
# The target starts once the speculator listens: each times its prefill
# attention kernels and its few-row GEMMs at start-up
# (--prefill_attention=auto, --decode_gemm=auto), and two
# services timing on one GPU at once would measure each other. (On
# Kubernetes they have a GPU each.)
read -r -a EXTRA <<< "${SERVICE_ARGS:-}"
read -r -a SPEC_EXTRA <<< "${SPECULATOR_ARGS:-}"
read -r -a TARGET_EXTRA <<< "${TARGET_ARGS:-}"
launch speculator_service --model "$SPECULATOR" --port 0 \
  --metrics_port 0 --device "$DEVICE" \
  --gpu_memory_utilization "${SPECULATOR_GPU_UTIL:-0.15}" \
  ${EXTRA[@]+"${EXTRA[@]}"} ${SPEC_EXTRA[@]+"${SPEC_EXTRA[@]}"}
SPORT=$(port speculator_service)
launch target_service --model "$TARGET" --port 0 --metrics_port 0 \
  --device "$DEVICE" --gpu_memory_utilization "${TARGET_GPU_UTIL:-0.75}" \
  ${EXTRA[@]+"${EXTRA[@]}"} ${TARGET_EXTRA[@]+"${TARGET_EXTRA[@]}"}
TPORT=$(port target_service)
TMPORT=$(sed -n 's/.*metrics on \([0-9]*\).*/\1/p' "$LOGS/target_service.log" | head -1)
HPORT=$(python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); \
print(s.getsockname()[1]); s.close()")
RPORT=$(start router --port 0 --metrics_port 0 --http_port "$HPORT" \
  --speculator "127.0.0.1:$SPORT" --target "127.0.0.1:$TPORT")
echo "stack up: speculator :$SPORT, target :$TPORT, router :$RPORT" \
     "(HTTP :$HPORT, device $DEVICE)" >&2

VOCAB=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['vocab_size'])" \
  "$TARGET/config.json")
# ids LEN TAG: the path of a file of LEN random token ids seeded by LEN
# and TAG, comma-separated, BOS-free. A file, not an argument: a
# 32K-token prompt exceeds the kernel's argument-length limit.
ids() {
  local f="$LOGS/prompt_$1_$2.txt"
  [ -e "$f" ] || python3 -c "import random,sys; r=random.Random(sys.argv[1] + '/' + sys.argv[3]); \
print(','.join(str(r.randrange(3, int(sys.argv[2]))) for _ in range(int(sys.argv[1]))))" \
    "$1" "$VOCAB" "$2" > "$f"
  echo "$f"
}
# ask LEN NEW TAG FLAGS...: the median over REPS of the client's JSON
# field FIELD (env), printed with 4 decimals; FIELD=parts prints one
# request's (the last rep's) TTFT parts instead, a Markdown row's cells. Every request has a prompt
# of its own (TAG and the rep seed it): the services' prefix caches must
# not serve one request's prefill from another's.
ask() {
  local len=$1 new=$2 tag=$3
  shift 3
  local prompt vals=()
  for ((r = 0; r < REPS; ++r)); do
    prompt=$(ids "$len" "$tag-$r")
    vals+=("$("$STACK/bin/client" --router "127.0.0.1:$RPORT" \
      --token_ids_file "$prompt" --max_new_tokens "$new" --temperature 0 \
      --deadline_ms 600000 --json "$@" |
      python3 -c "import json,sys; j=json.load(sys.stdin); s=j['stats']; \
u=j['usage']; d=max(1e-9, s['total_s']-s['ttft_s']); \
parts=[s['ttft_s'], s['speculate_s'], s['score_prefill_s'], s['score_look_ahead_s'], \
       s['score_select_s'], s['speculate_s']-s['score_total_s'], s['target_prefill_s'], \
       s['ttft_s']-s['speculate_s']-s['target_prefill_s']]; \
print(' | '.join('%.4f' % p for p in parts) if sys.argv[1]=='parts' else \
      s['ttft_s'] if sys.argv[1]=='ttft' else (u['completion_tokens']-1)/d)" "$FIELD")")
  done
  if [ "$FIELD" = parts ]; then
    printf '%s' "${vals[-1]}"
    return
  fi
  printf '%s\n' "${vals[@]}" | sort -g | awk '{v[NR]=$1} END {printf "%.4f", v[int((NR+1)/2)]}'
}

# Two untimed requests per configuration and length first: what a warm
# process has done (lazy kernel loading, cuBLAS heuristics, the first pool
# blocks, a cuDNN plan per chunk shape: full chunks plan at first sight, a
# kept tail once it has recurred enough to pay for its plan,
# CudnnPlanPolicy) is not a request's time to first token. Their own
# prompts: nothing timed below reuses their prefixes. (The services log
# each cuDNN plan built in a request: `cudnn plan N`.)
for WARM in $LENGTHS; do
  for W in 1 2; do
    FIELD=ttft REPS=1 ask "$WARM" 2 "warm$W-full" --no_spec_prefill \
      --no_spec_decode > /dev/null
    FIELD=ttft REPS=1 ask "$WARM" 2 "warm$W-keep" --keep_ratio 0.3 \
      --num_draft_tokens 4 > /dev/null
    FIELD=ttft REPS=1 ask "$WARM" 1 "warm$W-keep1" --keep_ratio 0.1 \
      --no_spec_decode > /dev/null
  done
done

echo "| prompt tokens | TTFT full prefill s | TTFT keep 0.3 s | TTFT keep 0.1 s |"
echo "|---|---|---|---|"
for L in $LENGTHS; do
  FIELD=ttft
  full=$(ask "$L" 1 full --no_spec_prefill --no_spec_decode)
  k3=$(ask "$L" 1 keep0.3 --keep_ratio 0.3 --no_spec_decode)
  k1=$(ask "$L" 1 keep0.1 --keep_ratio 0.1 --no_spec_decode)
  echo "| $L | $full | $k3 | $k1 |"
done
# Where a pruned request's TTFT goes (one request each, the router's and
# the speculator's own timings): the router's Score round trip, of it the
# speculator's prefill, look-ahead and scoring + selection, and what the
# speculator did not time (the RPC, its queue); the target's kept prefill
# from the router's send to the first token; the rest is the router's own.
echo
echo "| prompt tokens | keep | TTFT s | Score round trip s | score prefill s" \
     "| look-ahead s | scoring + selection s | RPC + queue s" \
     "| target prefill s | router rest s |"
echo "|---|---|---|---|---|---|---|---|---|---|"
for L in $LENGTHS; do
  FIELD=parts
  for K in 0.1 0.3; do
    echo "| $L | $K | $(REPS=1 ask "$L" 1 "parts$K" --keep_ratio "$K" \
      --no_spec_decode) |"
  done
done
echo
echo "| prompt tokens | decode tok/s, plain | decode tok/s, speculative k=4 |"
echo "|---|---|---|"
L=${LENGTHS%% *}
FIELD=decode
plain=$(ask "$L" "$NEW_TOKENS" plain --no_spec_prefill --no_spec_decode)
spec=$(ask "$L" "$NEW_TOKENS" spec --no_spec_prefill --num_draft_tokens 4)
echo "| $L | $plain | $spec |"

if [ "${CHECKS:-1}" = 1 ]; then
  echo
  ROUTER="127.0.0.1:$RPORT" CLIENT="$STACK/bin/client" WORK="$LOGS/checks" \
    bash tools/gpu/stack_checks.sh
fi

STREAMS=${STREAMS-"1 16 64 128"}
if [ -n "$STREAMS" ]; then
  echo
  echo "Concurrent streams through the OpenAI HTTP API (plain decode," \
       "${STREAM_PROMPT_TOKENS:-256}-token prompts, ${STREAM_NEW_TOKENS:-128}" \
       "new tokens, ignore_eos):"
  echo
  python3 tools/gpu/http_load.py --url "http://127.0.0.1:$HPORT" \
    --vocab "$VOCAB" --streams "${STREAMS// /,}" \
    --prompt_tokens "${STREAM_PROMPT_TOKENS:-256}" \
    --new_tokens "${STREAM_NEW_TOKENS:-128}" \
    --requests_per_stream "${STREAM_REQUESTS:-2}" \
    ${TMPORT:+--target_metrics "http://127.0.0.1:$TMPORT/metrics"}
fi

if [ "${ANCHOR:-auto}" != off ] && [ -n "$STREAMS" ] &&
   python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
     2>/dev/null; then
  # Our services hold most of the GPU's memory: stop them first.
  cleanup
  sleep 3
  echo
  echo "Anchor: transformers generate, static batch, same target, bf16 SDPA:"
  echo
  python3 bench/gpu/torch_bench.py --model "$TARGET" --prompt_lens "" \
    --batch_sizes "${STREAMS// /,}" \
    --batch_prompt_tokens "${STREAM_PROMPT_TOKENS:-256}" \
    --batch_new_tokens "${STREAM_NEW_TOKENS:-128}"
fi

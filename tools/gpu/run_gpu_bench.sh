#!/usr/bin/env bash
# Runs the CUDA backend benchmark on a GPU machine: writes the synthetic
# llama-3.2-1b (speculator) and llama-3.1-8b (target) checkpoints there
# (BF16, seed 0; never carried), runs gpu_bench from the bundle that
# tools/gpu/bundle_gpu_tests.sh made (BUNDLE, default .device/gpu) and,
# beside it on the same GPU, bench/gpu/torch_bench.py (PyTorch + transformers
# LlamaForCausalLM, SDPA, bf16) on the same target checkpoint.
#
#   tools/gpu/run_gpu_bench.sh [all|checkpoints|engine|torch] [extra gpu_bench flags]
#
# Stages let the work fit the device tool's 10-minute command limit while
# the machine stays warm between calls (checkpoints stay in $CKPT_DIR):
#   checkpoints  8B: 16 GB of BF16 drawn and written by every core (52 s on
#                the 2-core build machine; 1B: 5 s)
#   engine       gpu_bench (loads both models, ~1 min, then the runs)
#   torch        torch_bench.py on the target
# With the device tool, e.g.:
#   run(command="tools/gpu/run_gpu_bench.sh checkpoints", carry=[".device/gpu"])
#   run(command="tools/gpu/run_gpu_bench.sh engine", carry=[".device/gpu"])
#   run(command="tools/gpu/run_gpu_bench.sh torch")
# Results (JSON + logs) go to $RESULTS_DIR: $OUT when set (the device tool
# returns it), else bench/results/gpu. Copy them into bench/results/ and
# the README with the GPU and the command.
set -euo pipefail
cd "$(dirname "$0")/../.."
STAGE=${1:-all}
[ $# -gt 0 ] && shift
CKPT_DIR=${CKPT_DIR:-/tmp/specserve_gpu_ckpt}
RESULTS_DIR=${RESULTS_DIR:-${OUT:-bench/results/gpu}}
BUNDLE=${BUNDLE:-.device/gpu}
BIN=$BUNDLE/bin
mkdir -p "$CKPT_DIR" "$RESULTS_DIR"
if [ "$STAGE" != torch ] && [ ! -x "$BIN/gpu_bench" ]; then
  echo "run_gpu_bench: $BIN/gpu_bench not found; run" \
       "tools/gpu/bundle_gpu_tests.sh on the build machine and carry" \
       "$BUNDLE" >&2
  exit 3
fi
export LD_LIBRARY_PATH="$BUNDLE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# shellcheck source=tools/gpu/gpu_env.sh
source tools/gpu/gpu_env.sh
unpack_bundle_libs "$BUNDLE/lib"

write_checkpoint() {  # preset
  local dir="$CKPT_DIR/$1"
  if [ -s "$dir/model.safetensors" ] && [ -s "$dir/config.json" ]; then
    echo "checkpoint $dir exists"
    return 0
  fi
  "$BIN/make_synthetic_checkpoint" --preset "$1" --out "$dir" --seed 0 \
    --dtype BF16
}

if [ "$STAGE" = all ] || [ "$STAGE" = checkpoints ]; then
  # The two writes are independent: run them side by side.
  write_checkpoint llama-3.2-1b &
  pid=$!
  write_checkpoint llama-3.1-8b
  wait "$pid"
fi

if [ "$STAGE" = all ] || [ "$STAGE" = engine ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm \
    --format=csv | tee "$RESULTS_DIR/gpu_info.txt" || true
  "$BIN/gpu_bench" --speculator "$CKPT_DIR/llama-3.2-1b" \
    --target "$CKPT_DIR/llama-3.1-8b" \
    --json_out "$RESULTS_DIR/gpu_bench.json" "$@" 2>&1 |
    tee "$RESULTS_DIR/gpu_bench.log"
fi

if [ "$STAGE" = all ] || [ "$STAGE" = torch ]; then
  PYTHONUNBUFFERED=1 python3 bench/gpu/torch_bench.py \
    --model "$CKPT_DIR/llama-3.1-8b" \
    --json_out "$RESULTS_DIR/torch_bench.json" 2>&1 |
    tee "$RESULTS_DIR/torch_bench.log"
fi

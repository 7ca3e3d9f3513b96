#!/usr/bin/env bash
# The GPU stack benchmark (tools/gpu/run_stack_bench.sh) end to end without
# a GPU: the router, the speculator and the target built with
# --config=cuda_emu run `--device cuda` on the emulated device
# (common/cuda/emu), on the bundled stories260K-draft -> stories260K pair,
# at sizes the CPU can emulate. What it shows: the services' CUDA path
# (pool sizing from --gpu_memory_utilization, CUDA graphs, device sampling,
# batched attention under continuous batching), the client, the HTTP load
# generator and the bench script itself work together; every request
# succeeds and every table is printed. Its figures mean nothing. Run by
# tools/test.sh; by hand:
#
#   tools/gpu/emu_stack_smoke.sh [extra bazel build flags]
set -euo pipefail
cd "$(dirname "$0")/../.."
BINS=(//router:router //speculator_service:speculator_service
      //target_service:target_service //tools:client
      //tools:make_synthetic_checkpoint)
bazel build --config=cuda_emu "${BINS[@]}" "$@"
BIN_DIR=$(bazel info --config=cuda_emu bazel-bin 2>/dev/null)
WORK=$(mktemp -d -t specserve-emu-stack.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/stack/bin" "$WORK/stack/lib"
for t in "${BINS[@]}"; do
  p=${t#//}
  cp "$BIN_DIR/${p%%:*}/${p##*:}" "$WORK/stack/bin/"
done

# On a failure: why, then the end of each service's log.
fail() {
  echo "emu_stack_smoke: $*" >&2
  for f in "$WORK"/logs/*.log; do
    echo "--- $f" >&2
    tail -20 "$f" >&2
  done
  exit 1
}
# --nowarm_up: an emulated graph step is sized for the bucket's capacity
# and costs about a second, so the start-up capture of every bucket in both
# services would add two minutes (CudaModelRunner::WarmUp has its own test
# on the emulated device, ModelTest.WarmUpCapturesEveryBucket...). Graphs
# are captured here as the streams reach each bucket.
if ! STACK="$WORK/stack" LOGS="$WORK/logs" DEVICE=cuda \
  SERVICE_ARGS=--nowarm_up \
  SPECULATOR=models/stories260K-draft TARGET=models/stories260K \
  LENGTHS="100 300" REPS=1 NEW_TOKENS=8 SPECULATOR_GPU_UTIL=0.2 \
  TARGET_GPU_UTIL=0.3 STREAMS="1 40" STREAM_PROMPT_TOKENS=64 \
  STREAM_NEW_TOKENS=16 STREAM_REQUESTS=1 ANCHOR=off \
  tools/gpu/run_stack_bench.sh | tee "$WORK/out.md"; then
  fail "run_stack_bench.sh failed"
fi
# Both model services ran on the (emulated) CUDA device, pool sized from
# --gpu_memory_utilization.
for s in speculator_service target_service; do
  grep -q "on cuda, sized by --gpu_memory_utilization" "$WORK/logs/$s.log" ||
    fail "$s did not size a CUDA KV pool"
done
# Decode steps ran from CUDA graphs, and no capture failed.
grep -q "cuda graph captured: 1-row bucket, greedy" \
  "$WORK/logs/target_service.log" || fail "the target captured no graph"
if grep -q "cuda graphs off" "$WORK"/logs/*_service.log; then
  fail "a service turned CUDA graphs off"
fi
# Every table is there with a number in each cell.
for L in 100 300; do
  grep -Eq "^\| $L \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \|$" "$WORK/out.md" ||
    fail "no TTFT row for $L"
done
grep -Eq "^\| 100 \| [0-9.]+ \| [0-9.]+ \|$" "$WORK/out.md" ||
  fail "no decode row"
grep -Eq "^\| 300 \| 0\.1 \|( -?[0-9.]+ \|){8}$" "$WORK/out.md" ||
  fail "no TTFT parts row"
grep -q "Concurrent streams" "$WORK/out.md" || fail "no streams table"
# 40 streams decoded together from a graph of their bucket.
grep -q "cuda graph captured: 40-row bucket, greedy" \
  "$WORK/logs/target_service.log" || fail "no 40-row graph"
echo "emu_stack_smoke: OK"

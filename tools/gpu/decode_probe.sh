#!/usr/bin/env bash
# A short device call that looks into decode speed, from the session bundle
# (tools/gpu/bundle_device.sh): (1) the batched attention kernel's time and
# K / V read rate over 4K and 32K contexts, planned three ways
# (CudaTest.ReportsTimeOfBatchedAttentionOverLongContexts), then Nsight
# Compute's view of one decode launch at 32K (occupancy, warp stalls,
# memory throughput), where ncu is installed; (2) 64 HTTP streams through
# the stack with the target scheduler's forward / gap columns and
# nvidia-smi dmon's clocks and load beside them, once with CUDA graphs and
# once without. Written for the H200 session of 2026-11-29, where one
# decode row at 32K ran at ~400 GB/s of K / V and 64 streams got half the
# engine's batched decode.
#
#   tools/gpu/bundle_device.sh
#   run(command="tools/gpu/decode_probe.sh", carry=[".device/session"],
#       timeout_s=240)
#
# Env: RESULTS (default $OUT, else bench/results/probe), PARTS (default
# "kernel ncu stack").
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 3
RESULTS=${RESULTS:-${OUT:-bench/results/probe}}
PARTS=${PARTS:-"kernel ncu stack"}
mkdir -p "$RESULTS"
# Unpack the bundle (device_session.sh does it; no phase runs).
PHASES=none RESULTS=/tmp/probe_unpack tools/gpu/device_session.sh \
  > /dev/null 2>&1
ALL=.device/session/all
[ -x "$ALL/bin/cuda_backend_test" ] || { echo "no bundle in $ALL" >&2; exit 3; }
export LD_LIBRARY_PATH="$ALL/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# shellcheck source=tools/gpu/gpu_env.sh
source tools/gpu/gpu_env.sh
unpack_bundle_libs "$ALL/lib"
has() { [[ " $PARTS " == *" $1 "* ]]; }

ck_pid=
if has stack; then
  BUNDLE=$ALL tools/gpu/run_gpu_bench.sh checkpoints \
    > "$RESULTS/checkpoints.log" 2>&1 &
  ck_pid=$!
fi
if has kernel; then
  timeout 60 "$ALL/bin/cuda_backend_test" \
    --gtest_filter='*ReportsTimeOfBatchedAttention*' 2>&1 |
    tee "$RESULTS/kernel.log" | grep -E '^batched attention|FAILED|SKIPPED'
fi
if has ncu; then
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null |
    head -1)
  if [ -n "$NCU" ]; then
    # D=128: 4096 rows 1 at three plans x 23 launches, then 32768 rows 1:
    # skip 3 warm-ups of the first 32K plan, profile its first timed launch.
    timeout 90 "$NCU" --clock-control none -k regex:BatchedAttentionKernel \
      --launch-skip 72 --launch-count 1 --section SpeedOfLight \
      --section LaunchStats --section Occupancy --section WarpStateStats \
      --section SchedulerStats --section MemoryWorkloadAnalysis \
      "$ALL/bin/cuda_backend_test" \
      --gtest_filter='*ReportsTimeOfBatchedAttention*' \
      > "$RESULTS/ncu.log" 2>&1
    grep -vE '^batched attention|^\[' "$RESULTS/ncu.log" | tail -90
  else
    echo "decode_probe: no ncu on this machine" | tee "$RESULTS/ncu.log"
  fi
fi
if has stack; then
  wait "$ck_pid"
  for args in "" "--nocuda_graphs"; do
    tag=${args:-graphs}
    tag=${tag#--}
    nvidia-smi dmon -s pucm -d 1 > "$RESULTS/dmon_$tag.log" 2>&1 &
    dmon=$!
    STACK=$ALL LOGS="/tmp/probe_logs_$tag" LENGTHS=256 REPS=1 CHECKS=0 \
      ANCHOR=off STREAMS="64" STREAM_REQUESTS=2 SERVICE_ARGS="$args" \
      timeout 100 tools/gpu/run_stack_bench.sh > "$RESULTS/stack_$tag.log" 2>&1
    kill "$dmon" 2>/dev/null
    echo "== stack, ${args:-graphs on}"
    grep -E '^\|' "$RESULTS/stack_$tag.log" | tail -3
    echo "== dmon, ${args:-graphs on} (busiest seconds)"
    head -2 "$RESULTS/dmon_$tag.log"
    grep -vE '^#' "$RESULTS/dmon_$tag.log" | sort -k5 -n -r | head -6
  done
fi

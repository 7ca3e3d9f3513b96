#!/usr/bin/env bash
# Runs the CUDA backend tests (common/cuda/cuda_backend_test.cc and
# device_test.cc) on a GPU machine from the self-contained binary that
# tools/gpu/build_gpu_tests.sh built into .device/gpu. Needs the CUDA 13
# driver and cuBLAS 13 (toolkit or the pip wheel); no Bazel, no Debian
# libraries. Runs from the repository root (the tests open models/...).
#
#   tools/gpu/run_gpu_tests.sh [gtest flags, e.g. --gtest_filter=Attention*]
#
# With the device tool (carry the binaries; they are git-ignored):
#   run(command="tools/gpu/run_gpu_tests.sh 2>&1 | tee $OUT/gpu_tests.log",
#       carry=[".device/gpu"])
#
# Exit status: the test binary's; 3 if the binary is missing; 4 if every
# GPU test skipped (no device visible), unless ALLOW_NO_GPU=1 (then 0).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 3
BIN=${BIN:-.device/gpu/cuda_backend_test}
if [ ! -x "$BIN" ]; then
  echo "run_gpu_tests: $BIN not found; run tools/gpu/build_gpu_tests.sh" \
       "on the build machine and carry .device/gpu" >&2
  exit 3
fi
# shellcheck source=tools/gpu/gpu_env.sh
source tools/gpu/gpu_env.sh
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
fi
if ldd "$BIN" | grep -q "not found"; then
  echo "run_gpu_tests: unresolved libraries:" >&2
  ldd "$BIN" | grep "not found" >&2
  exit 3
fi

LOG=$(mktemp)
"$BIN" --gtest_color=no "$@" 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 0 ] && grep -q "no CUDA device" "$LOG" &&
   [ "${ALLOW_NO_GPU:-0}" != 1 ]; then
  echo "run_gpu_tests: the GPU tests skipped: no CUDA device visible" >&2
  rc=4
fi
rm -f "$LOG"
exit "$rc"

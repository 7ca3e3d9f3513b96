#!/usr/bin/env bash
# Runs the CUDA backend's tests (every test program listed in
# $BUNDLE/tests.txt: common/cuda's cc_tests) on a GPU machine from the
# bundle tools/gpu/bundle_gpu_tests.sh made (default .device/gpu). Needs
# the CUDA 13 driver and cuBLAS 13 (toolkit or the pip wheel); no Bazel,
# no Debian libraries. Runs from the repository root (the tests open
# models/...).
#
#   tools/gpu/run_gpu_tests.sh [gtest flags, e.g. --gtest_filter=Attention*]
#
# With the device tool (carry the bundle; it is git-ignored):
#   run(command="tools/gpu/run_gpu_tests.sh 2>&1 | tee $OUT/gpu_tests.log",
#       carry=[".device/gpu"])
#
# Exit status: 0 when every program passed; 1 when one failed (each one
# still runs); 3 if the bundle is missing or incomplete; 4 if GPU tests
# skipped for want of a device, unless ALLOW_NO_GPU=1 (then 0).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 3
BUNDLE=${BUNDLE:-.device/gpu}
if [ ! -s "$BUNDLE/tests.txt" ]; then
  echo "run_gpu_tests: $BUNDLE/tests.txt not found; run" \
       "tools/gpu/bundle_gpu_tests.sh on the build machine and carry" \
       "$BUNDLE" >&2
  exit 3
fi
export LD_LIBRARY_PATH="$BUNDLE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# shellcheck source=tools/gpu/gpu_env.sh
source tools/gpu/gpu_env.sh
unpack_bundle_libs "$BUNDLE/lib"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
fi

rc=0
skipped=0
LOG=$(mktemp)
while read -r name; do
  bin="$BUNDLE/bin/$name"
  if [ ! -x "$bin" ]; then
    echo "run_gpu_tests: $bin missing" >&2
    exit 3
  fi
  # cuBLAS is dlopen()ed on first use (not listed by ldd); the rest must
  # resolve from the bundle.
  if ldd "$bin" | grep -q "not found"; then
    echo "run_gpu_tests: unresolved libraries of $bin:" >&2
    ldd "$bin" | grep "not found" >&2
    exit 3
  fi
  echo "run_gpu_tests: $name"
  "$bin" --gtest_color=no "$@" 2>&1 | tee "$LOG"
  status=${PIPESTATUS[0]}
  if [ "$status" -ne 0 ]; then
    echo "run_gpu_tests: $name exited $status" >&2
    rc=1
  fi
  if grep -q "no CUDA device" "$LOG"; then skipped=1; fi
done < "$BUNDLE/tests.txt"
rm -f "$LOG"
if [ "$rc" -eq 0 ] && [ "$skipped" -eq 1 ] && [ "${ALLOW_NO_GPU:-0}" != 1 ]; then
  echo "run_gpu_tests: the GPU tests skipped: no CUDA device visible" >&2
  rc=4
fi
exit "$rc"

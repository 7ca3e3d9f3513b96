#!/usr/bin/env bash
# Checks tools/gpu/bundle_gpu_tests.sh and run_gpu_tests.sh without a GPU:
# bundles the Bazel-built CUDA test and bench programs, checks that every
# library they need (but glibc and cuBLAS) resolves from the bundle, that
# the bundle lists every cc_test of common/cuda, then runs the tests from
# the bundle in an empty environment: they must pass with every GPU test
# skipped (run_gpu_tests.sh exit 4, or 0 with ALLOW_NO_GPU=1), and
# gpu_bench must refuse to run without a device (exit 2).
set -euo pipefail
ROOT="$PWD"
GPU="${TEST_TMPDIR:-$(mktemp -d)}/gpu"
BINARIES_FROM="$ROOT" bash tools/gpu/bundle_gpu_tests.sh "$GPU"
for b in attention_plan_test cuda_backend_test device_test gpu_bench \
         make_synthetic_checkpoint; do
  test -x "$GPU/bin/$b"
  LD_LIBRARY_PATH="$GPU/lib" ldd "$GPU/bin/$b" > "$GPU/ldd.txt"
  if grep -q "not found" "$GPU/ldd.txt"; then
    cat "$GPU/ldd.txt" >&2
    exit 1
  fi
  # Abseil and the C++ runtime come from the bundle, not the system.
  if grep -E "libabsl_status\.|libstdc\+\+|libcudart" "$GPU/ldd.txt" |
     grep -v "$GPU/lib"; then
    echo "$b resolves a library outside the bundle" >&2
    exit 1
  fi
done
for lib in libstdc++.so.6 libgcc_s.so.1 libcudart.so.13 libopenblas.so.0.gz \
           libgfortran.so.5; do
  test -e "$GPU/lib/$lib"
done
# What travels to the GPU machine (with the ~11 MiB of tracked files) must
# stay under the device tool's 64 MiB.
size_kib=$(du -sk "$GPU" | cut -f1)
if [ "$size_kib" -gt $((48 * 1024)) ]; then
  echo "bundle is ${size_kib} KiB, over 48 MiB" >&2
  exit 1
fi
# Every cc_test of common/cuda (plain, or the GPU side of a
# cuda_test_with_emu_twin) is in the bundle's list, but the *_emu_test
# twins (the emulated device, for machines without a GPU).
{
  sed -n 's/^ *name = "\(.*\)",$/\1/p' <(awk '/^(cc_test|cuda_test_with_emu_twin)\(/ {t = 1} t && /name =/ {print; t = 0}' \
    common/cuda/BUILD.bazel) | grep -v '_emu_test$'
  # The GPU tests outside common/cuda.
  echo model_runner_factory_test
} | sort > "$GPU/want.txt"
sort "$GPU/tests.txt" > "$GPU/have.txt"
if ! diff "$GPU/want.txt" "$GPU/have.txt"; then
  echo "tests.txt differs from the cc_tests of common/cuda/BUILD.bazel" >&2
  exit 1
fi

run_env=(env -i PATH=/usr/bin:/bin HOME="$GPU" BUNDLE="$GPU")
set +e
"${run_env[@]}" bash tools/gpu/run_gpu_tests.sh > "$GPU/run.log" 2>&1
rc=$?
set -e
cat "$GPU/run.log"
if [ "$rc" -ne 4 ]; then
  echo "run_gpu_tests.sh exited $rc, want 4 (passed, GPU tests skipped)" >&2
  exit 1
fi
grep -q "no CUDA device" "$GPU/run.log"
# run_gpu_tests.sh restored the gzipped OpenBLAS the CPU reference loads.
test -e "$GPU/lib/libopenblas.so.0"
grep -q "^\[  PASSED  \]" "$GPU/run.log"
if grep -q "^\[  FAILED  \]" "$GPU/run.log"; then exit 1; fi
"${run_env[@]}" ALLOW_NO_GPU=1 bash tools/gpu/run_gpu_tests.sh \
  --gtest_filter='*Split*' > /dev/null 2>&1
set +e
"${run_env[@]}" LD_LIBRARY_PATH="$GPU/lib" "$GPU/bin/gpu_bench" \
  --speculator x --target y > "$GPU/bench.log" 2>&1
rc=$?
set -e
cat "$GPU/bench.log"
[ "$rc" -eq 2 ]
du -sh "$GPU" | awk '{print "bundle size: " $1}'
echo ok

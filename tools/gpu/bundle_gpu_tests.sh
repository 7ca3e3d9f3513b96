#!/usr/bin/env bash
# Bundles the CUDA backend's test and benchmark programs, built by Bazel,
# for a machine with no Bazel or Debian libraries (the GPU machine), the
# way bundle_stack.sh bundles the services:
#
#   OUT/bin/cuda_backend_test, device_test,  the cc_tests of common/cuda
#     attention_plan_test, flash_mma_test,
#     cudnn_attention_test,
#     kv_pool_sizing_test, step_inputs_test,
#     prefill_tuning_test,
#     sampling_kernels_test,
#     skinny_linear_test,                    (gtest)
#     model_runner_factory_test              (common/engine: the CUDA
#                                            runner through the factory,
#                                            pool sizing and warm-up)
#   OUT/bin/gpu_bench                        bench/gpu/gpu_bench.cc
#   OUT/bin/make_synthetic_checkpoint        synthetic weights for the bench
#   OUT/lib/                                 their shared libraries
#   OUT/tests.txt                            the test programs, one a line
#
# Each binary comes with the shared libraries it needs
# (deploy/docker/bundle.sh), plus libstdc++, libgcc_s and the CUDA runtime
# (that machine's distribution may be older than Debian 12), plus OpenBLAS
# and its gfortran runtime: the tests compare against the CPU engine, which
# dlopen()s libopenblas.so.0. Not bundled: glibc (>= 2.36 on the host:
# built on Debian 12) and cuBLAS (the toolkit or the PyTorch wheel;
# tools/gpu/gpu_env.sh finds it), nor cuDNN (dlopen()ed; gpu_env.sh finds
# the PyTorch wheel's). Binaries are stripped and OpenBLAS (35 MiB)
# is stored gzipped (11 MiB; gpu_env.sh's unpack_bundle_libs restores it
# on the GPU machine): ~31 MiB in all, so that with the ~11 MiB of tracked
# files it stays under the device tool's 64 MiB for what travels.
#
#   tools/gpu/bundle_gpu_tests.sh [OUT]        (default .device/gpu)
#   then carry OUT with the device tool and run tools/gpu/run_gpu_tests.sh
#   or tools/gpu/run_gpu_bench.sh
#
# BINARIES_FROM=DIR skips the Bazel build and takes the binaries from
# DIR/common/cuda/cuda_backend_test, ... (bazel-bin layout; the bundle
# test, //tools/gpu:bundle_gpu_tests_test, uses this).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-.device/gpu}
BIN_ROOT=${BINARIES_FROM:-bazel-bin}
# Every CUDA cc_test goes to the GPU machine; keep in step with
# common/cuda/BUILD.bazel (the bundle test checks the list is complete).
TESTS=(common/cuda/attention_plan_test common/cuda/cuda_backend_test
       common/cuda/cudnn_attention_test
       common/cuda/device_test common/cuda/flash_mma_test
       common/cuda/kv_pool_sizing_test common/cuda/prefill_tuning_test
       common/cuda/sampling_kernels_test common/cuda/skinny_linear_test
       common/cuda/step_inputs_test
       common/engine/model_runner_factory_test)
PROGRAMS=(bench/gpu/gpu_bench tools/make_synthetic_checkpoint)
if [ -z "${BINARIES_FROM:-}" ]; then
  bazel build -c opt //common/cuda:attention_plan_test \
    //common/cuda:cuda_backend_test //common/cuda:cudnn_attention_test \
    //common/cuda:device_test \
    //common/cuda:flash_mma_test //common/cuda:kv_pool_sizing_test \
    //common/cuda:prefill_tuning_test \
    //common/cuda:sampling_kernels_test //common/cuda:skinny_linear_test \
    //common/cuda:step_inputs_test //common/engine:model_runner_factory_test \
    //bench/gpu:gpu_bench //tools:make_synthetic_checkpoint
fi
rm -rf "$OUT"
mkdir -p "$OUT"
for t in "${TESTS[@]}" "${PROGRAMS[@]}"; do
  bash deploy/docker/bundle.sh "$BIN_ROOT/$t" "$OUT"
done
for t in "${TESTS[@]}"; do basename "$t"; done > "$OUT/tests.txt"
# The C++ runtime the binaries were linked against (GCC 12's) and the CUDA
# runtime (0.7 MB, redistributable; cuBLAS, 600+ MB, is not bundled).
for lib in libstdc++.so.6 libgcc_s.so.1 libcudart.so.13; do
  path=$(ldd "$BIN_ROOT/common/cuda/cuda_backend_test" |
         awk -v l="$lib" '$1 == l {print $3}')
  if [ -z "$path" ]; then
    echo "bundle_gpu_tests: cuda_backend_test does not link $lib" >&2
    exit 1
  fi
  cp -L "$path" "$OUT/lib/$lib"
done
# OpenBLAS for the CPU reference (dlopen()ed, so ldd does not list it).
openblas=$(readlink -f /usr/lib/x86_64-linux-gnu/libopenblas.so.0)
cp -L "$openblas" "$OUT/lib/libopenblas.so.0"
ldd "$openblas" | awk '$1 ~ /^lib(gfortran|quadmath)/ {print $1, $3}' |
  while read -r name path; do cp -L "$path" "$OUT/lib/$name"; done
chmod -R u+w "$OUT"
strip --strip-unneeded "$OUT"/bin/*
# Every library must resolve from the bundle alone (plus glibc, CUDA).
missing=0
for b in "$OUT"/bin/* "$OUT/lib/libopenblas.so.0"; do
  if LD_LIBRARY_PATH="$OUT/lib" ldd "$b" |
     grep -v -E 'libcu(da|blas|blasLt)\.' | grep -q "not found"; then
    echo "bundle_gpu_tests: unresolved libraries for $b" >&2
    LD_LIBRARY_PATH="$OUT/lib" ldd "$b" | grep "not found" >&2
    missing=1
  fi
done
[ "$missing" -eq 0 ] || exit 1
# The largest file by far; unpack_bundle_libs (gpu_env.sh) restores it.
gzip -9 "$OUT/lib/libopenblas.so.0"
du -sh "$OUT" | awk '{print "bundle_gpu_tests: " $1 " in '"$OUT"'"}'

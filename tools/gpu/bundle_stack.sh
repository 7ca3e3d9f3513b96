#!/usr/bin/env bash
# Bundles the serving stack for a machine with no Bazel, gRPC or Debian
# libraries (the GPU machine): router, speculator_service,
# target_service, the gRPC client (tools/client) and
# make_synthetic_checkpoint, each with the shared libraries it needs
# (deploy/docker/bundle.sh), plus libstdc++ and libgcc_s because that
# machine's distribution may be older than Debian 12. glibc and CUDA's
# libraries but the CUDA runtime are not bundled: glibc comes from the host
# (>= 2.36: built on Debian 12), cuBLAS from the toolkit or the PyTorch
# wheel (tools/gpu/gpu_env.sh), OpenBLAS only with WITH_OPENBLAS=1 (the CPU
# engine; 36 MB). ~30 MB without it.
#
#   tools/gpu/bundle_stack.sh [OUT]        (default .device/stack)
#   then carry OUT with the device tool and run tools/gpu/run_stack_bench.sh
#
# BINARIES_FROM=DIR skips the Bazel build and takes the five binaries from
# DIR/{router/router,...} (bazel-bin layout; the bundle test uses this).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-.device/stack}
BIN_ROOT=${BINARIES_FROM:-bazel-bin}
TARGETS=(router/router speculator_service/speculator_service
         target_service/target_service tools/client
         tools/make_synthetic_checkpoint)
if [ -z "${BINARIES_FROM:-}" ]; then
  bazel build -c opt //router //speculator_service //target_service \
    //tools:client //tools:make_synthetic_checkpoint
fi
rm -rf "$OUT"
mkdir -p "$OUT"
for t in "${TARGETS[@]}"; do
  bash deploy/docker/bundle.sh "$BIN_ROOT/$t" "$OUT"
done
# The C++ runtime the binaries were linked against (GCC 12's) and the CUDA
# runtime (0.7 MB, redistributable; cuBLAS, 600+ MB, is not bundled).
for lib in libstdc++.so.6 libgcc_s.so.1 libcudart.so.13; do
  path=$(ldd "$BIN_ROOT/target_service/target_service" |
         awk -v l="$lib" '$1 == l {print $3}')
  if [ -n "$path" ]; then cp -L "$path" "$OUT/lib/$lib"; fi
done
# OpenBLAS (dlopen'ed by the CPU engine only) is 36 MB: with it the bundle
# passes the device tool's 64 MiB carry limit, so it is opt-in.
if [ "${WITH_OPENBLAS:-0}" = 1 ]; then
  cp -L /usr/lib/x86_64-linux-gnu/libopenblas.so.0 "$OUT/lib/"
  ldd /usr/lib/x86_64-linux-gnu/libopenblas.so.0 |
    awk '$1 ~ /^lib(gfortran|quadmath)/ {print $3}' |
    while read -r path; do cp -L "$path" "$OUT/lib/"; done
fi
chmod -R u+w "$OUT"
# Every library must resolve from the bundle alone (plus glibc, CUDA).
missing=0
for b in "$OUT"/bin/*; do
  if LD_LIBRARY_PATH="$OUT/lib" ldd "$b" | grep -v -E 'libcu(da|blas|blasLt|dart)' |
     grep -q "not found"; then
    echo "bundle_stack: unresolved libraries for $b" >&2
    missing=1
  fi
done
[ "$missing" -eq 0 ] || exit 1
du -sh "$OUT" | awk '{print "bundle_stack: " $1 " in '"$OUT"'"}'

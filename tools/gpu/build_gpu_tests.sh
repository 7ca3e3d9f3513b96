#!/usr/bin/env bash
# Builds the CUDA backend's test and benchmark programs as self-contained
# binaries for a GPU machine that has the CUDA 13 driver (and ideally the
# toolkit's cuBLAS) but no Bazel and no Debian libraries:
#
#   .device/gpu/cuda_backend_test        the tests of common/cuda (gtest)
#   .device/gpu/gpu_bench                bench/gpu/gpu_bench.cc
#   .device/gpu/make_synthetic_checkpoint   synthetic weights for the bench
#
# Linked statically: libstdc++/libgcc, Abseil, GoogleTest, OpenBLAS (+ its
# gfortran runtime) and the CUDA runtime (libcudart_static). Left dynamic:
# glibc, and cuBLAS / cuBLASLt (the toolkit ships no static cuBLAS here;
# libcublasLt alone is 540 MB), found at run time through the rpath
# ($ORIGIN/lib, /usr/local/cuda/lib64) or LD_LIBRARY_PATH, which
# tools/gpu/run_gpu_tests.sh sets (it also finds the pip wheel's copy).
#
# Usage: tools/gpu/build_gpu_tests.sh [-j JOBS]     (from anywhere)
# Env: CUDA_HOME (default /usr/local/cuda), CXX (default g++), OUT_DIR
# (default .device/gpu; .device/ is git-ignored, so carry it explicitly:
# the three binaries take ~35 MB of the device tool's 64 MiB). Objects are
# cached in OBJ_DIR (default .device/gpu-obj, not needed on the GPU
# machine) and rebuilt when their source or any header of the tree is
# newer. The library objects go into an archive so each program links only
# what it uses (only the test needs OpenBLAS, for the CPU reference).
set -euo pipefail
cd "$(dirname "$0")/../.."

JOBS=2
while getopts "j:" opt; do
  case "$opt" in
    j) JOBS="$OPTARG" ;;
    *) echo "usage: $0 [-j JOBS]" >&2; exit 2 ;;
  esac
done

CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
CXX=${CXX:-g++}
OUT_DIR=${OUT_DIR:-.device/gpu}
OBJ_DIR=${OBJ_DIR:-.device/gpu-obj}
NVCC="$CUDA_HOME/bin/nvcc"
LIBDIR=/usr/lib/x86_64-linux-gnu

for f in "$NVCC" "$CUDA_HOME/lib64/libcudart_static.a" \
         "$CUDA_HOME/lib64/libcublas.so" "$LIBDIR/libgtest.a" \
         "$LIBDIR/libabsl_base.a"; do
  if [ ! -e "$f" ]; then
    echo "build_gpu_tests: missing $f (CUDA 13 toolkit in $CUDA_HOME," \
         "libgtest-dev, libabsl-dev)" >&2
    exit 1
  fi
done
OPENBLAS_A=$(readlink -f "$LIBDIR/libopenblas.a")
GFORTRAN_A=$($CXX -print-file-name=libgfortran.a)
QUADMATH_A=$($CXX -print-file-name=libquadmath.a)

# Same flags as the Bazel build (.bazelrc): x86-64-v3, C++17, optimised.
CXXFLAGS=(-std=c++17 -O2 -DNDEBUG -march=x86-64-v3 -DNOMINMAX -Wall
          -Wno-sign-compare -I. -idirafter "$CUDA_HOME/include"
          -DGTEST_HAS_PTHREAD=1 -pthread)
# shellcheck disable=SC2054  # the commas belong to -gencode's values
NVCCFLAGS=(-std=c++17 -O3 -Xcompiler -fPIC
           -gencode arch=compute_90,code=sm_90
           -gencode arch=compute_90,code=compute_90
           --expt-relaxed-constexpr -I.)

LIB_SRCS=(
  common/model/config.cc common/model/safetensors.cc common/model/weights.cc
  common/model/synthetic.cc
  common/engine/kernels.cc common/engine/thread_pool.cc
  common/engine/block_pool.cc common/engine/prefix_cache.cc
  common/engine/paged_kv_cache.cc
  common/engine/model_runner.cc common/engine/cpu_model_runner.cc
  common/specprefill/importance.cc common/specprefill/selection.cc
  common/cuda/device.cc common/cuda/cuda_status.cc common/cuda/device_buffer.cc
  common/cuda/linear.cc common/cuda/cuda_weights.cc
  common/cuda/cuda_model_runner.cc common/cuda/cuda_importance.cc
)
CU_SRCS=(common/cuda/kernels.cu common/cuda/attention.cu
         common/cuda/importance.cu)
TEST_SRCS=(common/cuda/cuda_backend_test.cc common/cuda/device_test.cc)
BENCH_SRCS=(bench/gpu/gpu_bench.cc)
SYNTH_SRCS=(tools/make_synthetic_checkpoint.cc)

mkdir -p "$OUT_DIR" "$OBJ_DIR"
# Newest header in the tree: objects older than it are rebuilt.
HEADER_STAMP="$OBJ_DIR/.headers"
newest=$(find common bench tools \( -name '*.h' -o -name '*.cuh' \) \
           -printf '%T@ %p\n' | sort -n | tail -1 | cut -d' ' -f2-)
touch -r "$newest" "$HEADER_STAMP"

obj_of() { echo "$OBJ_DIR/$(echo "$1" | tr / _).o"; }

export -f obj_of
export OBJ_DIR NVCC HEADER_STAMP CXX
export CXXFLAGS_STR="${CXXFLAGS[*]}" NVCCFLAGS_STR="${NVCCFLAGS[*]}"

echo "build_gpu_tests: compiling with $JOBS jobs into $OBJ_DIR"
# shellcheck disable=SC2016  # the script is expanded by the inner bash
printf '%s\n' "${LIB_SRCS[@]}" "${CU_SRCS[@]}" "${TEST_SRCS[@]}" \
    "${BENCH_SRCS[@]}" "${SYNTH_SRCS[@]}" |
  xargs -P "$JOBS" -I{} bash -c '
    set -e
    read -r -a CXXFLAGS <<< "$CXXFLAGS_STR"
    read -r -a NVCCFLAGS <<< "$NVCCFLAGS_STR"
    src={}
    obj=$(obj_of "$src")
    if [ -e "$obj" ] && [ "$obj" -nt "$src" ] && [ "$obj" -nt "$HEADER_STAMP" ]; then exit 0; fi
    echo "  compile $src"
    case "$src" in
      *.cu) "$NVCC" "${NVCCFLAGS[@]}" -c "$src" -o "$obj" ;;
      *) "$CXX" "${CXXFLAGS[@]}" -c "$src" -o "$obj" ;;
    esac'

objs() { for s in "$@"; do obj_of "$s"; done; }
ABSL_LIBS=$(ls "$LIBDIR"/libabsl_*.a)
link() {  # output, objects...
  local out=$1
  shift
  echo "  link $out"
  # shellcheck disable=SC2086,SC2016
  "$CXX" -o "$out" "$@" \
    -static-libstdc++ -static-libgcc \
    -Wl,--start-group "$LIBDIR/libgmock_main.a" "$LIBDIR/libgmock.a" \
      "$LIBDIR/libgtest.a" $ABSL_LIBS -Wl,--end-group \
    "$OPENBLAS_A" "$GFORTRAN_A" "$QUADMATH_A" \
    "$CUDA_HOME/lib64/libcudart_static.a" \
    -L"$CUDA_HOME/lib64" -Wl,--as-needed -lcublas -lcublasLt \
    -Wl,-rpath,'$ORIGIN/lib:/usr/local/cuda/lib64' \
    -ldl -lrt -lpthread -lm
  strip --strip-unneeded "$out"
}

LIB_A="$OBJ_DIR/libspecserve_gpu.a"
rm -f "$LIB_A"
# shellcheck disable=SC2046
ar rcs "$LIB_A" $(objs "${LIB_SRCS[@]}" "${CU_SRCS[@]}")
# shellcheck disable=SC2046
link "$OUT_DIR/cuda_backend_test" $(objs "${TEST_SRCS[@]}") "$LIB_A"
# shellcheck disable=SC2046
link "$OUT_DIR/gpu_bench" $(objs "${BENCH_SRCS[@]}") "$LIB_A"
# shellcheck disable=SC2046
link "$OUT_DIR/make_synthetic_checkpoint" $(objs "${SYNTH_SRCS[@]}") "$LIB_A"

echo "build_gpu_tests: done:"
ls -la "$OUT_DIR"/cuda_backend_test "$OUT_DIR"/gpu_bench \
  "$OUT_DIR"/make_synthetic_checkpoint
echo "dynamic libraries needed:"
ldd "$OUT_DIR/cuda_backend_test" | sed 's/^/  /'

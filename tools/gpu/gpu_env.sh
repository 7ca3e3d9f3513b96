# shellcheck shell=bash
# Sourced by the tools/gpu run_*.sh scripts: makes cuBLAS 13 (and cuDNN 9,
# where one is installed) loadable for the bundled binaries (everything else
# comes with the bundle), and defines unpack_bundle_libs.

# find_lib_dir LIB [LIB...]: the first folder holding every LIB: $CUDA_HOME/
# lib64, the usual toolkit folders, then the pip wheels PyTorch brings
# (nvidia/**: nvidia-cublas, nvidia-cudnn, ...; torch/lib).
find_lib_dir() {
  local d lib found
  for d in "${CUDA_HOME:-/usr/local/cuda}/lib64" /usr/local/cuda/lib64 \
           /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-13*/lib64 \
           /usr/lib/x86_64-linux-gnu; do
    found=1
    for lib in "$@"; do [ -e "$d/$lib" ] || found=0; done
    if [ "$found" = 1 ]; then
      echo "$d"
      return 0
    fi
  done
  if command -v python3 >/dev/null 2>&1; then
    python3 - "$@" <<'PY' 2>/dev/null && return 0
import glob, os, site, sys
libs = sys.argv[1:]
roots = site.getsitepackages() + [site.getusersitepackages()] + sys.path
for root in roots:
    for pattern in ("nvidia/**/" + libs[0], "torch/lib/" + libs[0]):
        for hit in glob.glob(os.path.join(root, pattern), recursive=True):
            d = os.path.dirname(hit)
            if all(os.path.exists(os.path.join(d, l)) for l in libs):
                print(d)
                sys.exit(0)
sys.exit(1)
PY
  fi
  return 1
}

# prepend_library_path DIR: DIR first on LD_LIBRARY_PATH (once).
prepend_library_path() {
  case ":${LD_LIBRARY_PATH:-}:" in
    *":$1:"*) ;;
    *) export LD_LIBRARY_PATH="$1${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
  esac
}

if CUBLAS_DIR=$(find_lib_dir libcublas.so.13 libcublasLt.so.13); then
  prepend_library_path "$CUBLAS_DIR"
  echo "gpu_env: cuBLAS from $CUBLAS_DIR"
else
  echo "gpu_env: libcublas.so.13 / libcublasLt.so.13 not found (CUDA 13" \
       "toolkit or the nvidia-cublas wheel); set CUDA_HOME" >&2
fi

# cuDNN 9 is optional: --prefill_attention=cudnn and cudnn_attention_test
# use it, everything else runs without. The GPU machine's toolkit has none;
# PyTorch's wheel brings one (nvidia-cudnn).
if CUDNN_DIR=$(find_lib_dir libcudnn.so.9); then
  prepend_library_path "$CUDNN_DIR"
  echo "gpu_env: cuDNN from $CUDNN_DIR"
else
  echo "gpu_env: libcudnn.so.9 not found (optional: only" \
       "--prefill_attention=cudnn needs it)"
fi
# cuDNN's fused attention engines for Hopper compile their kernels at run
# time with NVRTC (the toolkit's, or PyTorch's nvidia-cuda-nvrtc wheel),
# dlopen()ed by the major version cuDNN was built for: 13 for a CUDA 13
# cuDNN, 12 where PyTorch's wheel brings the CUDA 12 one. Both go on the
# path where both are found.
NVRTC_FOUND=0
for v in 13 12; do
  if NVRTC_DIR=$(find_lib_dir "libnvrtc.so.$v"); then
    prepend_library_path "$NVRTC_DIR"
    echo "gpu_env: NVRTC $v from $NVRTC_DIR"
    NVRTC_FOUND=1
  fi
done
if [ "$NVRTC_FOUND" = 0 ]; then
  echo "gpu_env: libnvrtc.so.13 / .so.12 not found: cuDNN attention will" \
       "fall back"
fi

# glibc >= 2.36 is needed (binaries built on Debian 12).
GLIBC_VERSION=$(ldd --version 2>/dev/null | head -1 | grep -o '[0-9]*\.[0-9]*$' || true)
echo "gpu_env: glibc ${GLIBC_VERSION:-unknown}"

# unpack_bundle_libs DIR: restores the libraries a bundle stores gzipped
# (bundle_gpu_tests.sh gzips OpenBLAS to fit the device tool's size limit).
unpack_bundle_libs() {
  local gz
  for gz in "$1"/*.gz; do
    [ -e "$gz" ] || continue
    [ -e "${gz%.gz}" ] || gzip -dc "$gz" > "${gz%.gz}"
  done
}

#!/usr/bin/env bash
# Installs the Debian 12 packages specserve builds, tests and runs with.
# Idempotent and non-interactive; does nothing when all are present.
set -euo pipefail

PACKAGES=(
  bazel-bootstrap g++ pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev libgtest-dev libgmock-dev libbenchmark-dev
  libsentencepiece-dev nlohmann-json3-dev libopenblas-dev libonig-dev
  libutf8proc-dev
  python3 python3-grpcio python3-numpy
  python3-protobuf python3-yaml prometheus yamllint
  clang-14 libclang-rt-14-dev
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]})); then
  echo "installing: ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

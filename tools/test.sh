#!/usr/bin/env bash
# Runs every test: the whole Bazel test suite, then the safetensors header
# mutation test again under AddressSanitizer.
set -euo pipefail
cd "$(dirname "$0")/.."

bazel test //... "$@"
bazel test --config=asan //common/model:safetensors_fuzz_test "$@"

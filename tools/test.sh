#!/usr/bin/env bash
# Runs every test: the whole Bazel test suite, then the safetensors header
# mutation test again under AddressSanitizer, then the libFuzzer targets.
# Tests that compare against npm reference packages (tokenizers, templates,
# the OpenAI client) find them through SPECSERVE_NODE_MODULES, installed
# here first.
set -euo pipefail
cd "$(dirname "$0")/.."

SPECSERVE_NODE_MODULES="$(bash tools/install_npm_deps.sh)"
export SPECSERVE_NODE_MODULES

bazel test //... "$@"
bazel test --config=asan //common/model:safetensors_fuzz_test "$@"
# The fuzz targets under libFuzzer (clang-14, ASan + UBSan), 20 s each.
bazel test --config=fuzz //... "$@"

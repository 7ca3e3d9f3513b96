#!/usr/bin/env bash
# Runs every test: the whole Bazel test suite, then the services' tests and
# the end-to-end test under AddressSanitizer + UBSan and ThreadSanitizer,
# then the libFuzzer targets.
# Tests that compare against npm reference packages (tokenizers, templates,
# the OpenAI client) find them through SPECSERVE_NODE_MODULES, installed
# here first.
set -euo pipefail
cd "$(dirname "$0")/.."

SPECSERVE_NODE_MODULES="$(bash tools/install_npm_deps.sh)"
export SPECSERVE_NODE_MODULES

bazel test //... "$@"
# The services' tests and the end-to-end test under ASan + UBSan and under
# TSan (.bazelrc; sentencepiece through the built-in tokenizer), plus the
# safetensors header mutation test and the built-in sentencepiece
# tokenizer's tests under ASan.
SANITIZED=(//speculator_service/... //target_service/... //router/...
           //common/scheduling/... //common/speculation/... //tests:e2e_test)
bazel test --config=asan "${SANITIZED[@]}" //common/model:safetensors_fuzz_test \
  //common/tokenizer:spm_builtin_test //common/tokenizer:tokenizer_test \
  //tests:tls_test //tests:faults_test //tests:openai_client_test "$@"
# Under TSan gRPC core's hand-offs between its threads are modeled as
# happens-before edges (third_party/sanitizers/tsan_grpc_sync.cc), checked
# from both sides by tsan_grpc_sync_test.
bazel test --config=tsan "${SANITIZED[@]}" \
  //third_party/sanitizers:tsan_grpc_sync_test //tests:tls_test \
  //tests:faults_test //tests:openai_client_test "$@"
# The fuzz targets under libFuzzer (clang-14, ASan + UBSan), 20 s each.
bazel test --config=fuzz //... "$@"

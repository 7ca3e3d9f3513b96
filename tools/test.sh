#!/usr/bin/env bash
# Runs every test: the whole Bazel test suite, the stack on the emulated
# CUDA device, then the services' tests and the end-to-end test under
# AddressSanitizer + UBSan and ThreadSanitizer, then the libFuzzer targets.
# Tests that compare against npm reference packages (tokenizers, templates,
# the OpenAI client) find them through SPECSERVE_NODE_MODULES, installed
# here first.
set -euo pipefail
cd "$(dirname "$0")/.."

SPECSERVE_NODE_MODULES="$(bash tools/install_npm_deps.sh)"
export SPECSERVE_NODE_MODULES

# Every step's output also goes to one log; at the end (pass or fail) the
# steps' wall times and the slowest test targets are printed from it, so a
# test creeping towards its timeout shows before it fails.
LOG=$(mktemp -t specserve-test.XXXXXX)
STEPS=()
report() {
  echo "=== step wall times"
  printf '%s\n' "${STEPS[@]}"
  echo "=== slowest test targets (all steps; sharded: the slowest shard)"
  tools/slowest_tests.sh "$LOG" 15
  rm -f "$LOG"
}
trap report EXIT
step() {
  local name=$1 start=$SECONDS
  shift
  bazel test "$@" 2>&1 | tee -a "$LOG"
  STEPS+=("$name: $((SECONDS - start)) s")
}

# Layering: the router has no model, so it must not link the engine or a
# model service's code (docs/ARCHITECTURE.md).
for forbidden in //common/engine/... //common/cuda/... //common/speculation/... \
                 //speculator_service/... //target_service/...; do
  path=$(bazel query "somepath(//router:router, $forbidden)" 2>/dev/null)
  if [ -n "$path" ]; then
    echo "layering: //router:router depends on $forbidden through:" >&2
    echo "$path" >&2
    exit 1
  fi
done
echo "layering: //router:router links no engine or model-service code"

step plain //... "$@"
# The GPU stack benchmark's script with the services on the emulated CUDA
# device (--config=cuda_emu): the CUDA serving path end to end, no GPU.
start=$SECONDS
bash tools/gpu/emu_stack_smoke.sh 2>&1 | tee -a "$LOG"
STEPS+=("emulated stack: $((SECONDS - start)) s")
# The services' tests and the end-to-end test under ASan + UBSan and under
# TSan (.bazelrc; sentencepiece through the built-in tokenizer), plus the
# safetensors header mutation test, the built-in sentencepiece
# tokenizer's tests and the chat templates' Jinja tests under ASan.
SANITIZED=(//speculator_service/... //target_service/... //router/...
           //common/scheduling/... //common/speculation/... //tests:e2e_test)
step asan --config=asan "${SANITIZED[@]}" //common/model:safetensors_fuzz_test \
  //common/tokenizer:spm_builtin_test //common/tokenizer:tokenizer_test \
  //common/chat:jinja_test \
  //tests:tls_test //tests:faults_test //tests:openai_client_test "$@"
# Under TSan gRPC core's hand-offs between its threads are modeled as
# happens-before edges (third_party/sanitizers/tsan_grpc_sync.cc), checked
# from both sides by tsan_grpc_sync_test.
step tsan --config=tsan "${SANITIZED[@]}" \
  //third_party/sanitizers:tsan_grpc_sync_test //tests:tls_test \
  //tests:faults_test //tests:openai_client_test "$@"
# The fuzz targets under libFuzzer (clang-14, ASan + UBSan), 20 s each.
step fuzz --config=fuzz //... "$@"

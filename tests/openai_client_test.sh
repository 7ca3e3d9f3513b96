#!/usr/bin/env bash
# Bazel sh_test wrapper: Debian's python3 runs the OpenAI-client end-to-end
# test from the runfiles root (node runs the client itself).
set -euo pipefail
exec /usr/bin/python3 tests/openai_client_test.py "$@"

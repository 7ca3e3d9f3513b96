#!/usr/bin/env bash
# Bazel sh_test wrapper: Debian's python3 runs the OpenAI-client end-to-end
# test from the runfiles root (node runs the client itself), through
# run_python.sh, which fails the test on any ThreadSanitizer report a
# service writes under --config=tsan.
set -euo pipefail
exec bash tests/run_python.sh tests/openai_client_test.py "$@"

#!/usr/bin/env bash
# Bazel sh_test wrapper: Debian's python3 (with python3-grpcio) runs the
# end-to-end tests from the runfiles root.
set -euo pipefail
exec /usr/bin/python3 tests/e2e_test.py "$@"

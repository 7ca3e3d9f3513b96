#!/usr/bin/env bash
# Bazel sh_test wrapper: Debian's python3 (with python3-grpcio) runs the
# test script given as $1 from the runfiles root.
set -euo pipefail
exec /usr/bin/python3 "$@"

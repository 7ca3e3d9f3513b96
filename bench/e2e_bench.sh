#!/usr/bin/env bash
# `bazel run -c opt //bench:e2e_bench -- [flags]`: runs bench/e2e_bench.py
# with Debian's python3 (python3-grpcio) from the runfiles tree, where the
# service binaries and models are.
set -euo pipefail
exec /usr/bin/python3 bench/e2e_bench.py "$@"

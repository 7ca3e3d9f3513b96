#!/usr/bin/env bash
# `bazel run -c opt //bench:serving_bench -- [flags]`: runs
# bench/serving_bench.py with Debian's python3 (python3-grpcio) from the
# runfiles tree, where the service binaries and models are.
set -euo pipefail
exec /usr/bin/python3 bench/serving_bench.py "$@"

#!/usr/bin/env bash
# Runs a Python test with Debian's python3 (python3-yaml, python3-grpcio)
# from the runfiles root: run_python.sh SCRIPT [ARGS...].
set -euo pipefail
export PYTHONPATH="deploy/tests${PYTHONPATH:+:$PYTHONPATH}"
exec /usr/bin/python3 "$@"

#!/usr/bin/env bash
# The quickstart's main job: installs what is missing, builds the three
# services and the client, starts speculator (stories260K-draft), target
# (stories260K) and router on loopback, sends a real prompt through the
# router, prints the generated text and the stats, and shuts everything
# down. Extra arguments go to //tools:client (e.g. --keep_ratio 0.5 --stream).
# To keep the stack running for other clients: tools/run_stack.py --serve
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install_deps.sh
bazel build //router //speculator_service //target_service //tools:client
exec /usr/bin/python3 tools/run_stack.py --demo -- "$@"

#!/usr/bin/env bash
# The quickstart's main job: installs what is missing, builds, and generates
# a story with the bundled target model (stories260K), printing the text and
# timings. Extra arguments go to //tools:generate, e.g. --max_new_tokens 32.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install_deps.sh
bazel run //tools:generate -- \
  --model models/stories260K \
  --prompt "Once upon a time, there was a little dog named Max." \
  --max_new_tokens 96 --stop_token_ids 1 "$@"

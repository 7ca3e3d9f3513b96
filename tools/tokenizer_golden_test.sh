#!/usr/bin/env bash
# Regenerates the byte-level tokenizer goldens with node and transformers.js
# (tools/tokenizer_golden.js) and requires them to equal the checked-in
# common/tokenizer/testdata/*.jsonl: the goldens are reproducible and
# up to date with the script. Needs node and SPECSERVE_NODE_MODULES
# (tools/install_npm_deps.sh); fails clearly without them.
set -euo pipefail
if [[ -z "${SPECSERVE_NODE_MODULES:-}" ]]; then
  echo "SPECSERVE_NODE_MODULES is not set: run" \
    "'export SPECSERVE_NODE_MODULES=\$(bash tools/install_npm_deps.sh)'" >&2
  exit 1
fi
command -v node > /dev/null || { echo "node is not installed" >&2; exit 1; }
OUT="${TEST_TMPDIR:-/tmp}/tokenizer_golden"
node tools/tokenizer_golden.js "$SPECSERVE_NODE_MODULES" "$OUT"
for name in llama3 qwen3 qwen3_strip; do
  if ! cmp -s "$OUT/$name.jsonl" "common/tokenizer/testdata/$name.jsonl"; then
    echo "common/tokenizer/testdata/$name.jsonl differs from a fresh run of" \
      "tools/tokenizer_golden.js:" >&2
    diff <(head -c 100000 "common/tokenizer/testdata/$name.jsonl") \
      <(head -c 100000 "$OUT/$name.jsonl") | head -20 >&2 || true
    exit 1
  fi
done
echo "goldens reproduce: $(cat "$OUT"/*.jsonl | wc -l) lines"

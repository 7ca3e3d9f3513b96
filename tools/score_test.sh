#!/usr/bin/env bash
# End-to-end check of //tools:score on the bundled speculator: the golden
# Speculative Prefill case (tests/data/golden/specprefill_case2.json, an
# independent float64 reference, no forced keeps), the JSON shape with
# --prompt and forced keeps, and exit status 2 for bad input.
set -euo pipefail
SCORE="$1"
GOLDEN=tests/data/golden/specprefill_case2.json
MODEL=models/stories260K-draft
TMP="${TEST_TMPDIR:-/tmp}"

ids=$(python3 -c "import json; print(','.join(map(str, json.load(open('$GOLDEN'))['prompt_token_ids'])))")
read -r keep chunk pool la < <(python3 -c "
import json; p = json.load(open('$GOLDEN'))['params']
print(p['keep_fraction'], p['chunk_size'], p['pool_kernel'], p['lookahead_N'])")
"$SCORE" --model "$MODEL" --token_ids "$ids" --keep_ratio "$keep" \
  --chunk_size "$chunk" --pool_kernel_size "$pool" --look_ahead "$la" \
  --keep_first 0 --keep_last 0 --print_importance > "$TMP/case2.json"
python3 - "$TMP/case2.json" "$GOLDEN" <<'PY'
import json, sys
out = json.load(open(sys.argv[1])); g = json.load(open(sys.argv[2]))
assert list(out) == ["kept_indices", "position_ids", "next_position",
                     "look_ahead_token_ids", "importance"], list(out)
assert out["kept_indices"] == g["kept_token_indices"], out["kept_indices"]
assert out["position_ids"] == out["kept_indices"]
assert out["next_position"] == g["n_prompt"]
assert out["look_ahead_token_ids"] == g["lookahead_token_ids"]
assert len(out["importance"]) == g["n_prompt"]
worst = max(abs(a - b) for a, b in zip(out["importance"], g["importance"]))
assert worst < 1e-4, worst
PY

# --prompt: sorted unique indices with the first and last token, count per
# the ceil rule (docs/ARCHITECTURE.md, Speculative Prefill step 6), no importance by default.
"$SCORE" --model "$MODEL" --prompt "Once upon a time, there was a little girl \
named Lily. She loved to play outside in the sunshine. One day, she saw a big \
red ball in the park." --keep_ratio 0.3 --chunk_size 4 --pool_kernel_size 13 \
  --look_ahead 8 > "$TMP/prompt.json"
python3 - "$TMP/prompt.json" <<'PY'
import json, math, sys
out = json.load(open(sys.argv[1]))
assert list(out) == ["kept_indices", "position_ids", "next_position",
                     "look_ahead_token_ids"], list(out)
k, n = out["kept_indices"], out["next_position"]
assert k == sorted(set(k)) and k[0] == 0 and k[-1] == n - 1, k
chunks = math.ceil(n / 4); kept_chunks = math.ceil(chunks * 0.3 - 1e-6)
assert (kept_chunks - 1) * 4 + 1 <= len(k) <= kept_chunks * 4 + 2, (n, len(k))
assert out["position_ids"] == k and len(out["look_ahead_token_ids"]) <= 8
PY

# Bad input: exit status 2 and a message naming the flag.
expect_bad() {
  local want="$1"; shift
  set +e; "$SCORE" --model "$MODEL" "$@" > /dev/null 2> "$TMP/err"; rc=$?; set -e
  [[ $rc == 2 ]] || { echo "want exit 2 for $*, got $rc"; exit 1; }
  grep -q -- "$want" "$TMP/err" || { echo "no '$want' in: $(cat "$TMP/err")"; exit 1; }
}
expect_bad "--keep_ratio" --token_ids 1,5,9 --keep_ratio 0
expect_bad "--keep_ratio" --token_ids 1,5,9 --keep_ratio 1.5
expect_bad "--chunk_size" --token_ids 1,5,9 --chunk_size 0
expect_bad "--pool_kernel_size" --token_ids 1,5,9 --pool_kernel_size 4
expect_bad "--look_ahead" --token_ids 1,5,9 --look_ahead 65
expect_bad "--token_ids" --token_ids 1,512
expect_bad "--token_ids" --token_ids 1,x
expect_bad "exactly one" --token_ids 1,5 --prompt hi
expect_bad "exactly one"
echo PASS

#!/usr/bin/env bash
# Edge cases of //bench:eval_retrieval:
#   1. a band where no prompt counts still writes its results (it crashed
#      reading a method entry that was not there);
#   2. a --counted_out whose folder does not exist is an error, before any
#      work, naming the path (it wrote nothing and said nothing);
#   3. by default nothing is written into the working directory (it wrote
#      bench/results and bench/data of the source tree): results and counted
#      prompts go under $TMPDIR/specserve_retrieval.
# Prompts whose answer the model never states count nothing, which keeps
# each run to one short continuation per prompt.
set -euo pipefail
EVAL="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
DIR="${TEST_TMPDIR:-$(mktemp -d)}/edges"
rm -rf "$DIR"
mkdir -p "$DIR"
fail() { echo "FAIL: $*" >&2; exit 1; }

for i in 1 2 3; do
  printf '{"kind":"name","template":"t","before":"Once upon a time there was a girl. ","fact":"Her name was Qzxv.","after":" One day, the girl met a dog. The girl said her name was","answer":"Qzxv"}\n'
done > "$DIR/p_short.jsonl"
common=(--pairs stories260K-draft:stories260K --bands short
        --prompts "$DIR/p_{band}.jsonl" --fidelity_prompts=
        --ratios 0.2,1.0 --masses 0.5)

# 1. No prompt counted: exit 0, complete results saying so.
rc=0
"$EVAL" "${common[@]}" --counted_out "$DIR/counted.jsonl" \
  --out_dir "$DIR/out" > "$DIR/stdout1" 2> "$DIR/stderr1" || rc=$?
test "$rc" = 0 || { cat "$DIR/stderr1" >&2; fail "no counted prompt: exit $rc"; }
test -s "$DIR/out/retrieval_results.md" || fail "no retrieval_results.md"
grep -q "3 prompts: 0 counted" "$DIR/out/retrieval_results.md" \
  || fail "markdown lacks the 0-counted summary"
grep -q "No prompt was counted" "$DIR/out/retrieval_results.md" \
  || fail "markdown does not say that there is nothing to compare"
test -f "$DIR/counted.jsonl" || fail "counted file not written"
test ! -s "$DIR/counted.jsonl" || fail "counted file not empty"
python3 - "$DIR/out/retrieval_results.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["pairs"]["stories260K-draft:stories260K"]
s = r["retrieval"]["short"]
assert s["prompts"] == 3 and s["counted"] == 0, s
assert s["full_prefill_wrong"] + s["guessable_without_fact"] == 3, s
assert s["methods"] == {}, s["methods"]
PY

# 2. --counted_out in a folder that does not exist: non-zero, named, early.
if "$EVAL" "${common[@]}" --counted_out "$DIR/missing/counted.jsonl" \
    --out_dir "$DIR/out2" > /dev/null 2> "$DIR/stderr2"; then
  fail "--counted_out in a missing folder exited 0"
fi
grep -q "counted_out" "$DIR/stderr2" || fail "error does not name the flag"
grep -q "$DIR/missing" "$DIR/stderr2" || fail "error does not name the folder"
test ! -e "$DIR/out2" || fail "results written despite the error"
test ! -e "$DIR/missing" || fail "the missing folder was created"

# 3. Defaults: nothing in the working directory, all under $TMPDIR.
WORK="$DIR/work"
mkdir -p "$WORK"
ln -s "$PWD/models" "$WORK/models"
(cd "$WORK" && TMPDIR="$DIR/tmp" "$EVAL" "${common[@]}" > /dev/null \
  2> "$DIR/stderr3") || { cat "$DIR/stderr3" >&2; fail "default run failed"; }
test -s "$DIR/tmp/specserve_retrieval/results/retrieval_results.json" \
  || fail "default results not under \$TMPDIR/specserve_retrieval/results"
test -f "$DIR/tmp/specserve_retrieval/counted/stories260K_short.jsonl" \
  || fail "default counted prompts not under \$TMPDIR/specserve_retrieval"
left=$(cd "$WORK" && ls -A | grep -v '^models$' || true)
test -z "$left" || fail "default run wrote into the working directory: $left"

# --help says where the defaults write.
help=$("$EVAL" --helpfull 2>&1 || true)
grep -q "specserve_retrieval/results" <<< "$help" \
  || fail "--help does not show the default output folder"
echo "ok"

#!/usr/bin/env bash
# CI smoke run of //bench:eval_retrieval on 150 short-distance prompts of the
# stories260K pair: checks that the results are complete and consistent
# (accuracies and Wilson intervals in range, keep_ratio 1 never loses a
# counted prompt, the baselines keep what Speculative Prefill keeps, keep by
# mass keeps less at a smaller mass).
set -euo pipefail
EVAL="$1"
GEN="$2"
DIR="${TEST_TMPDIR:-$(mktemp -d)}"
python3 "$GEN" --out "$DIR/stories260K_short.jsonl" --count 150 \
  --min_words 0 --max_words 10 --seed 161
"$EVAL" --pairs stories260K-draft:stories260K --bands short \
  --prompts "$DIR/{target}_{band}.jsonl" --counted_out "$DIR/counted.jsonl" \
  --ratios 0.2,1.0 --masses 0.5,0.95 --out_dir "$DIR/out" > /dev/null
test -s "$DIR/out/retrieval_results.md"

python3 - "$DIR/out/retrieval_results.json" "$DIR/counted.jsonl" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
r = j["pairs"]["stories260K-draft:stories260K"]["retrieval"]["short"]
n = r["counted"]
assert n >= 5, "too few prompts counted: %d" % n
assert r["prompts"] == 150
assert (r["counted"] + r["full_prefill_wrong"] + r["guessable_without_fact"]
        + r["too_long"]) == 150
assert sum(1 for _ in open(sys.argv[2])) == n
for m, v in r["methods"].items():
    cells = v["by_ratio"]
    assert len(cells) == 2, m
    for c in cells:
        assert c["n"] == n, (m, c)
        assert 0 <= c["ci95"][0] <= c["accuracy"] <= c["ci95"][1] <= 1, (m, c)
        assert 0 < c["kept_fraction"] <= 1, (m, c)
    # keep_ratio 1 keeps everything: the full prefill's answer, every time.
    if m.startswith("specprefill"):
        assert cells[1]["accuracy"] == 1.0, (m, cells[1])
        assert cells[1]["kept_fraction"] == 1.0, (m, cells[1])
for base in ("recent", "sink_recent", "random"):
    for c in ("8", "32"):
        a = r["methods"]["specprefill_c%s_la8" % c]["by_ratio"][0]
        b = r["methods"]["%s_c%s" % (base, c)]["by_ratio"][0]
        assert abs(a["kept_fraction"] - b["kept_fraction"]) < 1e-9, (base, c)
km = r["keep_mass"]
assert km[0]["kept_fraction"] < km[1]["kept_fraction"], km
print("ok: %d counted" % n)
PY

#!/usr/bin/env bash
# CI smoke run of //bench:eval_fidelity (--smoke: 3 prompts, keep 0.1 / 0.3 /
# 1.0, one random seed, two ablations, bundled speed only). Checks that the
# JSON is well-formed and complete, that every metric is in range, that keep
# ratio 1.0 reproduces the full-prompt target exactly for every method, that
# pruning at 0.1 really changes the target's output, and that the baselines
# keep exactly as many tokens as Speculative Prefill.
set -euo pipefail
EVAL="$1"
OUT="${TEST_TMPDIR:-$(mktemp -d)}/eval"

"$EVAL" --smoke --threads 1 --out_dir "$OUT"
test -s "$OUT/eval_results.md"
grep -q "does NOT beat" "$OUT/eval_results.md"

python3 - "$OUT/eval_results.json" <<'PY'
import json, math, sys
j = json.load(open(sys.argv[1]))
for key in ("meta", "prompts", "fidelity", "comparisons", "ablations", "speed"):
    assert key in j, key
baselines = {"random", "recent", "sink_recent"}
methods = {"specprefill", "specprefill_chunk8"} | baselines | \
    {b + "_c8" for b in baselines}
pairs = {p["pair"] for p in j["prompts"]}
assert pairs == {"stories260K", "tinystories-656K"}, pairs
rows = j["fidelity"]
assert len(rows) == len(pairs) * len(methods) * 3, len(rows)
assert {r["method"] for r in rows} == methods
for r in rows:
    for m in ("top1_agreement", "match_rate", "kept_fraction"):
        assert 0 <= r[m] <= 1, r
    assert math.isfinite(r["kl_mean"]) and r["kl_mean"] >= 0, r
    if r["keep_ratio"] == 1.0:
        # Nothing pruned: must be the full-prompt run, bit for bit.
        assert r["kept_fraction"] == 1, r
        assert r["top1_agreement"] == 1 and r["match_rate"] == 1, r
        assert r["kl_mean"] < 1e-9, r
# Every baseline keeps exactly as many tokens as the variant it is matched to.
kept = {(r["pair"], r["keep_ratio"], r["method"]): r["kept_fraction"] for r in rows}
for r in rows:
    if "count_matched_to" in r:
        ref = kept[(r["pair"], r["keep_ratio"], r["count_matched_to"])]
        assert abs(r["kept_fraction"] - ref) < 1e-12, r
# Pruning at 0.1 must move the next-token distribution for some method.
low = [r for r in rows if r["keep_ratio"] == 0.1]
assert all(r["kept_fraction"] < 1 for r in low)
assert max(r["kl_mean"] for r in low) > 1e-6, low
for c in j["comparisons"]:
    assert c["verdict"] in ("wins", "ties", "loses"), c
    assert c["advantage_se"] >= 0
assert len(j["ablations"]) == 3
for a in j["ablations"]:
    assert 0 <= a["top1_agreement"] <= 1 and a["kl_mean"] >= 0, a
s = j["speed"]
assert s["ttft"] and s["decode"]
for t in s["ttft"]:
    assert t["full_prefill_ms"] > 0 and t["ttft_ms"] > 0 and t["speedup"] > 0, t
    assert 0 < t["kept_tokens"] < t["prompt_tokens"], t
for d in s["decode"]:
    assert d["tokens_per_s"] > 0, d
    if d["k"] > 0:
        assert 0 <= d["acceptance_rate"] <= 1, d
        assert 1 <= d["mean_acceptance_length"] <= d["k"] + 1, d
print("PASS")
PY

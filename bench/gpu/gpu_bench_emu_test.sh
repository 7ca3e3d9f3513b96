#!/usr/bin/env bash
# Smoke run of gpu_bench on the emulated device (see BUILD.bazel): tiny
# checkpoints shaped like the GPU run's pair, small ceilings, one rep. The
# figures mean nothing here; the test checks that every stage ran and that
# the JSON holds what bench/results and the README are made from.
set -euo pipefail
BENCH="$1"
MAKE_CKPT="$2"
TMP="${TEST_TMPDIR:-$(mktemp -d)}"

for preset in llama-3.2-1b-tiny llama-3.1-8b-tiny; do
  "$MAKE_CKPT" --preset "$preset" --out "$TMP/$preset" --seed 0 --dtype BF16
done
"$BENCH" --speculator "$TMP/llama-3.2-1b-tiny" \
  --target "$TMP/llama-3.1-8b-tiny" --prompt_lens 96,200 --keep 0.1,0.3 \
  --lookahead 4 --chunk_size 8 --decode_tokens 2 --verify_ks 1,3 --reps 1 \
  --decode_batches 1,3 --decode_context 24 --service_chunk 64 \
  --alt_service_chunk 128 --decode_gemm cublas \
  --peak_gemm_size 64 --copy_bytes 1048576 --json_out "$TMP/gpu_bench.json" |
  tee "$TMP/gpu_bench.log"
# The chunked scoring prefill at both chunk sizes, per length.
for P in 96 200; do
  grep -Eq "^speculator prefill at $P: [0-9.]+ s in one pass, [0-9.]+ s in 64-row chunks \(as its service runs it\), [0-9.]+ s in 128-row chunks$" \
    "$TMP/gpu_bench.log" || { echo "no chunked prefill line for $P" >&2; exit 1; }
done

python3 - "$TMP/gpu_bench.json" <<'PY'
import json, math, sys
j = json.load(open(sys.argv[1]))
for key in ("device", "dtype", "command", "cublas_peak_tflops",
            "copy_bandwidth_gbps", "gemm", "rows"):
    assert key in j, key
assert j["dtype"] == "bf16", j["dtype"]
# The start-up tunings ran on both models (cuDNN does not run emulated).
for role in ("target", "speculator"):
    # cuBLAS: the tuning (80 trials) and SkinnyLinear in every step cost
    # a minute emulated; cuda_backend_emu_test checks both.
    line = j[role + "_decode_gemm_tuning"]
    assert line == "decode GEMMs: cuBLAS (--decode_gemm=cublas)", line
    line = j[role + "_prefill_tuning"]
    assert line.startswith("prefill attention: "), line
    assert "flash" in line and "mma" in line and "cudnn not run" in line, line
assert {(g["m"], g["gemm"]) for g in j["gemm"]} == {
    (m, g) for m in (96, 200) for g in ("qkv", "o", "gate_up", "down")}
# Each projection timed as the forward runs it (fp32 out for qkv, the
# residual add for o and down) and with a bf16 output.
forward = {"qkv": ("f32", 0), "o": ("f32", 1), "gate_up": ("bf16", 0),
           "down": ("f32", 1)}
for g in j["gemm"]:
    assert (g["out"], g["beta"]) == forward[g["gemm"]], g
    assert g["tflops"] > 0 and g["tflops_bf16_out"] > 0, g
# The batched decode stage: each B, graphs and eager, B=1 as the base.
bd = j["batched_decode"]
assert [d["batch"] for d in bd] == [1, 3], bd
for d in bd:
    assert d["context"] == 24, d
    for k in ("graph_step_s", "tok_s", "eager_step_s", "eager_tok_s",
              "gbps", "bw_fraction", "x_batch1"):
        assert math.isfinite(d[k]) and d[k] > 0, (k, d)
    assert abs(d["tok_s"] * d["graph_step_s"] - d["batch"]) <= 1e-4 * d["batch"], d
    # The graph run replayed (the first step of a bucket captures): the
    # figures are of graphs, not of a silent fall-back to eager.
    assert d["graph_replays"] >= 2, d
    # An eager run's phases: the untimed step and the 2 timed ones.
    ph = d["eager_phases"]
    assert ph["forwards"] == 3, ph
    assert ph["qkv_proj"] > 0 and ph["attention"] > 0, ph
assert bd[0]["x_batch1"] == 1, bd
rows = j["rows"]
assert [(r["prompt_len"], r["keep"]) for r in rows] == [
    (96, 0.1), (96, 0.3), (200, 0.1), (200, 0.3)], rows
positive = ("target_full_prefill_s", "target_full_prefill_mma_s",
            "target_best_full_prefill_s",
            "target_kept_prefill_s", "spec_prefill_s", "spec_lookahead_s",
            "scoring_s", "ttft_s", "target_decode_tok_s",
            "target_decode_eager_tok_s", "spec_decode_tok_s",
            "target_kept_prefill_chunked_s", "spec_prefill_chunked_s")
for r in rows:
    for k in positive:
        assert math.isfinite(r[k]) and r[k] > 0, (k, r)
    # Selection keeps whole chunks of 8 plus the last token; at least the
    # ratio's share and never the whole prompt.
    P, kept = r["prompt_len"], r["kept_tokens"]
    assert math.ceil(r["keep"] * P) <= kept < P, r
    # libcudnn does not load on the emulated device: no cuDNN timing, and
    # no pick of a "cudnn" that would have run FlashAttention.
    assert "target_full_prefill_cudnn_s" not in r, r
    assert r["attention_path"] in ("flash", "mma"), r
    assert [v["k"] for v in r["verify"]] == [1, 3], r
    assert all(v["seconds"] > 0 for v in r["verify"]), r
    # The JSON holds 6 significant digits: each value is off by up to
    # 5e-6 of itself (a 1e-6 bound failed once: 1.61865 vs 1.49076 +
    # 0.127888).
    t, s, k = r["ttft_s"], r["scoring_s"], r["target_kept_prefill_s"]
    assert abs(t - s - k) <= 1e-5 * (t + s + k) + 1e-9, r
    assert r["service_chunk"] == 64, r
# --phase_times: per length, each prefill's phases, one forward per chunk
# of 64 rows, timed within the wall time; every prefill projects, attends
# and makes logits.
ph = j["phases"]
assert [p["prompt_len"] for p in ph] == [96, 200], ph
names = ("embed", "norm", "qkv_proj", "rope_kv_store", "kv_gather",
         "attention", "row_gather", "o_proj", "gate_up_proj", "silu_mul",
         "down_proj", "logits")
for p in ph:
    P = p["prompt_len"]
    want = {"target_full_prefill": 1, "spec_prefill": 1,
            "spec_prefill_chunked": math.ceil(P / 64),
            "target_kept_prefill_chunked": None}
    assert set(want) <= set(p), p
    for what, forwards in want.items():
        t = p[what]
        assert set(names) <= set(t), (what, t)
        if forwards is not None:
            assert t["forwards"] == forwards, (what, t)
        assert t["forwards"] >= 1, (what, t)
        assert 0 < t["timed_s"] <= t["wall_s"] * (1 + 1e-5), (what, t)
        for n in ("qkv_proj", "attention", "gate_up_proj", "logits"):
            assert t[n] > 0, (what, n, t)
        assert abs(sum(t[n] for n in names) - t["timed_s"]) <= 1e-5 * t["timed_s"] + 1e-9, t
print("gpu_bench_emu_test: %d rows, %d phase sets OK" % (len(rows), len(ph)))
PY

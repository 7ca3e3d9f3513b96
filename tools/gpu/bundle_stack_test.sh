#!/usr/bin/env bash
# Checks tools/gpu/bundle_stack.sh and run_stack_bench.sh without a GPU:
# bundles the five binaries, checks that every library the binaries need
# (but glibc) resolves from the bundle, then runs the stack from the bundle
# in an empty environment on the CPU with the bundled models and checks
# that the TTFT, decode and concurrent-streams tables come back with
# numbers (the prompts go through the client's --token_ids_file, the
# streams through the router's OpenAI HTTP API).
set -euo pipefail
ROOT="$PWD"
STACK="${TEST_TMPDIR:-$(mktemp -d)}/stack"
BINARIES_FROM="$ROOT" bash tools/gpu/bundle_stack.sh "$STACK"
for b in router speculator_service target_service client \
         make_synthetic_checkpoint; do
  test -x "$STACK/bin/$b"
  # The gRPC and Abseil libraries come from the bundle, not the system.
  LD_LIBRARY_PATH="$STACK/lib" ldd "$STACK/bin/$b" > "$STACK/ldd.txt"
  if grep -q "not found" "$STACK/ldd.txt"; then
    cat "$STACK/ldd.txt" >&2
    exit 1
  fi
  grep -E "libabsl_status|libgrpc" "$STACK/ldd.txt" | grep -v "$STACK/lib" &&
    { echo "$b resolves a library outside the bundle" >&2; exit 1; }
done
test -e "$STACK/lib/libstdc++.so.6"
test -e "$STACK/lib/libcudart.so.13"

OUT=$(env -i PATH=/usr/bin:/bin HOME="$STACK" STACK="$STACK" DEVICE=cpu \
  SPECULATOR=models/stories260K-draft TARGET=models/stories260K \
  LENGTHS="96 300" REPS=1 NEW_TOKENS=12 STREAMS="1 3" STREAM_PROMPT_TOKENS=40 \
  STREAM_NEW_TOKENS=8 STREAM_REQUESTS=2 ANCHOR=off \
  bash tools/gpu/run_stack_bench.sh)
echo "$OUT"
# Two TTFT rows, four rows of TTFT parts (two lengths x keep 0.1 / 0.3),
# one decode row, every measured cell a positive number; the lossless
# checks; then one row per stream count: positive tokens/s, every request
# served.
python3 - "$OUT" <<'PY'
import sys
rows = [[c.strip() for c in l.strip().strip("|").split("|")]
        for l in sys.argv[1].splitlines()
        if l.startswith("| ") and l[2].isdigit()]
assert len(rows) == 9, rows
# stack_checks.sh ran: three drafting methods x two prefills, then sampling.
checks = [l for l in sys.argv[1].splitlines() if l.startswith("stack_checks:")]
assert len(checks) == 7 and checks[-1].endswith("OK"), checks
for cells in rows[:2] + rows[6:7]:
    assert all(float(c) > 0 for c in cells), cells
assert [(r[0], r[1]) for r in rows[2:6]] == [
    ("96", "0.1"), ("96", "0.3"), ("300", "0.1"), ("300", "0.3")], rows
for cells in rows[2:6]:
    # TTFT, the Score round trip and the speculator's three phases, the
    # untimed part of the round trip, the target's prefill, the rest.
    ttft, trip, pre, look, sel, rpc, tgt, rest = map(float, cells[2:])
    # (4 decimals: the tiny models' phases may take under 50 us and print
    # 0.)
    assert min(ttft, trip) > 0 and min(pre, look, sel, tgt) >= 0, cells
    assert min(rpc, rest) >= -1e-3 and trip < ttft, cells
    assert pre + look + sel <= trip, cells
assert [r[0] for r in rows[7:]] == ["1", "3"], rows
for streams, rate, ratio, requests, failed, *sched in rows[7:]:
    assert float(rate) > 0 and ratio.endswith("x"), rows
    assert int(requests) == 2 * int(streams) and int(failed) == 0, rows
    # The target scheduler's columns (http_load.py --target_metrics).
    forwards, seqs, rows_per, fwd_ms, gap_ms, busy = sched
    assert int(forwards) > 0 and float(seqs) >= 1.0, rows
    assert float(rows_per) >= 1 and float(fwd_ms) > 0, rows
    assert float(gap_ms) >= 0 and busy.endswith("%"), rows
print("ok")
PY

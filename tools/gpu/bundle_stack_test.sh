#!/usr/bin/env bash
# Checks tools/gpu/bundle_stack.sh and run_stack_bench.sh without a GPU:
# bundles the five binaries, checks that every library the binaries need
# (but glibc) resolves from the bundle, then runs the stack from the bundle
# in an empty environment on the CPU with the bundled models and checks
# that the TTFT and decode tables come back with numbers.
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
  LENGTHS="96 300" REPS=1 NEW_TOKENS=12 bash tools/gpu/run_stack_bench.sh)
echo "$OUT"
# Two TTFT rows and one decode row, every cell a positive number.
python3 - "$OUT" <<'PY'
import sys
rows = [l for l in sys.argv[1].splitlines()
        if l.startswith("| ") and l[2].isdigit()]
assert len(rows) == 3, rows
for r in rows:
    cells = [c.strip() for c in r.strip("|").split("|")]
    assert all(float(c) > 0 for c in cells), r
print("ok")
PY

#!/usr/bin/env bash
# Checks tools/gpu/bundle_device.sh and device_session.sh without a GPU:
# packs the Bazel-built test, bench and stack programs into the one tarball
# a device session carries, checks it leaves room under the device tool's
# 64 MiB, then runs device_session.sh from the tarball alone in an empty
# environment: first a dry run (it unpacks, finds every program, and plans
# the phases inside the budget), then the tests, engine and stack phases
# for real without a GPU: the GPU tests skip, gpu_bench runs on the
# emulated device, the stack on the CPU on the prefill path gpu_bench
# picked, and summary.md reports all three with the stack's tables.
set -euo pipefail
ROOT="$PWD"
EMU_BENCH="$ROOT/$1"  # gpu_bench on the emulated device
TMP="${TEST_TMPDIR:-$(mktemp -d)}"
SESSION="$TMP/session"
BINARIES_FROM="$ROOT" bash tools/gpu/bundle_device.sh "$SESSION"
# With the ~11 MiB of tracked files, what travels must stay under 64 MiB.
size_kib=$(du -sk "$SESSION/bundle.tar.xz" | cut -f1)
if [ "$size_kib" -gt $((40 * 1024)) ]; then
  echo "bundle.tar.xz is ${size_kib} KiB, over 40 MiB" >&2
  exit 1
fi

run_env=(env -i PATH=/usr/bin:/bin HOME="$TMP" SESSION="$SESSION")
"${run_env[@]}" RESULTS="$TMP/dry" DEVICE_SESSION_DRY=1 \
  bash tools/gpu/device_session.sh > "$TMP/dry.log" 2>&1 ||
  { cat "$TMP/dry.log"; exit 1; }
cat "$TMP/dry.log"
# The tarball unpacked to every program, the test list included.
for b in gpu_bench make_synthetic_checkpoint router speculator_service \
         target_service client cuda_backend_test; do
  test -x "$SESSION/all/bin/$b"
done
grep -q "^cuda_backend_test$" "$SESSION/all/tests.txt"
# The plan reaches the three phases the open issues need.
for p in tests engine stack; do
  grep -q "would run $p (up to [0-9]* s)" "$TMP/dry.log" ||
    { echo "the dry run plans no $p phase" >&2; exit 1; }
done

# For real, without a GPU: the tests skip; the engine phase runs gpu_bench
# built for the emulated device (swapped into the unpacked bundle) on tiny
# twins of the 1B / 8B pair, written where the session looks for the real
# ones; the stack runs on the CPU on the bundled pair.
cp "$EMU_BENCH" "$SESSION/all/bin/gpu_bench"
CKPT="$TMP/ckpt"
"$SESSION/all/bin/make_synthetic_checkpoint" --preset llama-3.2-1b-tiny \
  --out "$CKPT/llama-3.2-1b" --dtype BF16
"$SESSION/all/bin/make_synthetic_checkpoint" --preset llama-3.1-8b-tiny \
  --out "$CKPT/llama-3.1-8b" --dtype BF16
set +e
"${run_env[@]}" RESULTS="$TMP/real" PHASES="tests engine stack stack_alt" \
  STACK_ALT_LENGTHS=200 STACK_ALT_ARGS="--max_num_batched_tokens 256" \
  ALLOW_NO_GPU=1 CKPT_DIR="$CKPT" ENGINE_ARGS="--prompt_lens 96,200 \
  --keep 0.1 --lookahead 4 --chunk_size 8 --decode_tokens 2 --verify_ks 1 \
  --reps 1 --peak_gemm_size 64 --copy_bytes 1048576 --decode_batches 1,2 \
  --decode_context 16 --decode_gemm cublas" \
  DEVICE=cpu SPECULATOR=models/stories260K-draft TARGET=models/stories260K \
  STACK_LENGTHS="96 200" NEW_TOKENS=8 STREAMS="1 2" STREAM_PROMPT_TOKENS=32 \
  STREAM_NEW_TOKENS=8 ANCHOR=off BUDGET_S=500 \
  bash tools/gpu/device_session.sh > "$TMP/real.log" 2>&1
rc=$?
set -e
cat "$TMP/real.log"
[ "$rc" -eq 0 ] || { echo "device_session.sh exited $rc" >&2; exit 1; }
S="$TMP/real/summary.md"
grep -q "^| tests | passed | [0-9]* |$" "$S"
grep -q "^| stack | passed | [0-9]* |$" "$S"
grep -q "^| engine | passed | [0-9]* |$" "$S"
grep -q "^| stack_alt | passed | [0-9]* |$" "$S"
# The second stack's tables, under their own heading: its TTFT row and its
# one stream level.
sed -n '/^## stack with --max_num_batched_tokens 256$/,$p' "$S" > "$TMP/alt.md"
grep -Eq "^\| 200 \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \|$" "$TMP/alt.md" ||
  { echo "no TTFT row in the second stack's tables" >&2; exit 1; }
grep -Eq "^\| 64 \| [0-9.]+ \| " "$TMP/alt.md" ||
  { echo "no 64-stream row in the second stack's tables" >&2; exit 1; }
grep -q "no CUDA device" "$TMP/real/tests.log"
test -s "$TMP/real/gpu_bench.json"
# The stack ran on the path gpu_bench picked at its longest prompt (the
# tuning test skips without a GPU, so the services do not tune here).
picked=$(sed -n 's/^prefill attention for the rest of the 200 row: //p' \
  "$TMP/real/engine.log")
[[ "$picked" =~ ^(flash|mma|cudnn)$ ]] ||
  { echo "gpu_bench picked '$picked'" >&2; exit 1; }
# The engine's per-path prefill lines made it into the summary.
grep -q "^target full prefill at 200: " "$S"
# The chunked prefills, the phase times and the main table's rows too.
grep -q "^speculator prefill at 200: .* in 2048-row chunks" "$S"
grep -q "^target kept prefill at 200, keep 0.10 " "$S"
grep -q "^phases of the target's full prefill at 200 (1 forwards," "$S"
# The ceilings and the projections' GEMM MFU (forward / 16-bit output).
grep -q "^cuBLAS bf16 GEMM 64^3: " "$S"
grep -Eq "^  200 +( +[0-9.]+/ *[0-9.]+%){4}$" "$S" ||
  { echo "no GEMM MFU row for 200 in the summary" >&2; exit 1; }
grep -Eq "^200 +[0-9.]+ +[0-9.]+ +0\.10 " "$S" ||
  { echo "no engine table row for 200 in the summary" >&2; exit 1; }
grep -q "^target start-up tuning: prefill attention: " "$S"
grep -q "^speculator decode GEMM tuning: decode GEMMs: " "$S"
# The batched decode table too: its title and a line per B.
grep -q "^batched decode of the target at 16-token context" "$S"
for B in 1 2; do
  grep -Eq "^  $B +[0-9.]+ +[0-9.]+ " "$S" ||
    { echo "no batched decode line for B=$B in the summary" >&2; exit 1; }
done
grep -q "^Stack prefill attention: $picked " "$S" ||
  { echo "the stack did not run on $picked" >&2; exit 1; }
# The services get the picked --prefill_attention and nothing more.
grep -q "; service flags: --prefill_attention=$picked$" "$S" ||
  { echo "the stack's service flags are not the defaults" >&2; exit 1; }
# The stack's tables made it into the summary: two TTFT rows, a decode row.
for L in 96 200; do
  grep -Eq "^\| $L \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \|$" "$S" ||
    { echo "no TTFT row for $L in the summary" >&2; exit 1; }
done
grep -Eq "^\| 96 \| [0-9.]+ \| [0-9.]+ \|$" "$S"
grep -Eq "^\| 200 \| 0\.1 \|( -?[0-9.]+ \|){8}$" "$S" ||
  { echo "no TTFT parts row in the summary" >&2; exit 1; }
echo ok

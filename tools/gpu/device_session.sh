#!/usr/bin/env bash
# A whole device session in one call: the GPU tests of the work that has not
# run on a GPU yet, the engine benchmark, the stack benchmark through the
# router and, if time is left, the rest of the CUDA suite and the PyTorch
# anchor, in that order of value, inside a time budget. A device session is
# about 15 minutes of device time, start-up included, and one command may
# run 10: so everything goes in one call, each phase runs under its own
# deadline, and every phase writes its log to the results folder as it goes
# (the device tool returns what is there even when the call times out).
#
#   tools/gpu/bundle_device.sh                 # on the build machine
#   run(command="tools/gpu/device_session.sh", carry=[".device/session"],
#       timeout_s=600)
#
# Phases (each one starts only if the time it needs is left):
#   tests        the GPU tests of the newest work (GPU_FILTER)
#                (GPU_FILTER), while the synthetic 1B / 8B checkpoints are
#                written on the CPU side
#   engine       bench/gpu/gpu_bench (run_gpu_bench.sh engine): prefill
#                with each attention path, scoring, kept prefills, decode
#                eager and from graphs, verify
#   stack        run_stack_bench.sh, shortened (STACK_LENGTHS, REPS=1):
#                TTFT through the router, decode, the lossless checks, 1 /
#                16 / 64 / 128 HTTP streams and the transformers anchor
#   torch        bench/gpu/torch_bench.py, PyTorch's full prefill and decode
#   stack_alt    the stack again with STACK_ALT_ARGS added to both
#                services' flags (default --max_num_batched_tokens 2048,
#                the budget before the services took vLLM's 8192 on 70+
#                GiB GPUs), at STACK_ALT_LENGTHS (default 32768) and 64
#                streams: checks that default against the old one
#   suite        the rest of the CUDA tests (all but GPU_FILTER's)
# Then summary.md: each phase's status and seconds, and the tables.
#
# Env: BUDGET_S (default 560: seconds for the whole call, start to end),
# PHASES (default "tests engine stack torch stack_alt suite"), GPU_FILTER,
# STACK_ALT_ARGS, STACK_ALT_LENGTHS,
# ENGINE_ARGS (more gpu_bench flags), STACK_LENGTHS (default "4096
# 32768"), STACK_ATTENTION (the stack's
# --prefill_attention; default: auto once the tuning test passed, else the
# engine benchmark's pick), SPECULATOR /
# TARGET (the stack's models: no checkpoints are written), SESSION (the carried folder,
# default .device/session), RESULTS (default $OUT, else
# bench/results/session; under the device tool, a folder in /tmp that is
# packed into $OUT after every phase, see PACK), DEVICE_SESSION_DRY=1 (check the bundle and print
# the plan; run nothing: the CI check). Exit status: 0 when every phase
# that ran passed, 1 otherwise, 3 if the bundle is missing or incomplete.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 3
T0=$SECONDS
BUDGET_S=${BUDGET_S:-560}
PHASES=${PHASES:-"tests engine stack torch stack_alt suite"}
STACK_ALT_ARGS=${STACK_ALT_ARGS:-"--max_num_batched_tokens 2048"}
STACK_ALT_LENGTHS=${STACK_ALT_LENGTHS:-32768}
SESSION=${SESSION:-.device/session}
# The device tool returns at most 8 files from $OUT, and the phases write
# more (logs, JSON, the services' logs): under the tool the results are
# written in /tmp and packed after every phase into $OUT/results.tar.gz,
# with summary.md beside it, so a call stopped at its limit still returns
# what the finished phases wrote.
if [ -z "${RESULTS:-}" ] && [ -n "${OUT:-}" ]; then
  RESULTS=/tmp/device_session_results
  PACK=${PACK:-$OUT}
fi
RESULTS=${RESULTS:-bench/results/session}
PACK=${PACK:-}
GPU_FILTER=${GPU_FILTER:-'SkinnyLinear*:CudaTest.TuneSkinny*:Cudnn*:FlashMma*:SampleRows*:RowLogprobs*:BatchedAttention*:*/ModelTest.*:AttentionTest*:CudaTest.Argmax*:CudaTest.LoadEquals*:CudaTest.TunePrefill*:CudaTest.Cudnn*:CudaTest.ReportsTimeOfBatchedAttention*:ModelRunnerFactoryTest.*:PrefillTuningTest.*'}
STACK_LENGTHS=${STACK_LENGTHS:-"4096 32768"}
export CKPT_DIR=${CKPT_DIR:-/tmp/specserve_gpu_ckpt}
DRY=${DEVICE_SESSION_DRY:-0}
mkdir -p "$RESULTS"
pack() {
  [ -n "$PACK" ] && [ "$DRY" != 1 ] || return 0
  tar -czf "$PACK/results.tar.gz.part" -C "$RESULTS" . 2>/dev/null &&
    mv -f "$PACK/results.tar.gz.part" "$PACK/results.tar.gz"
  [ -s "$SUMMARY" ] && cp -f "$SUMMARY" "$PACK/summary.md"
  return 0
}
SUMMARY="$RESULTS/summary.md"

# The bundle: bundle_device.sh packs the test / bench bundle and the stack
# bundle into one xz tarball (the two side by side pass the carry limit).
ALL="$SESSION/all"
if [ ! -x "$ALL/bin/gpu_bench" ]; then
  if [ ! -s "$SESSION/bundle.tar.xz" ]; then
    echo "device_session: $SESSION/bundle.tar.xz not found: run" \
         "tools/gpu/bundle_device.sh and carry $SESSION" >&2
    exit 3
  fi
  mkdir -p "$ALL"
  if command -v xz > /dev/null 2>&1; then
    tar -xJf "$SESSION/bundle.tar.xz" -C "$ALL" || exit 3
  else  # a minimal image without xz-utils: Python's lzma reads it
    python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" \
      "$SESSION/bundle.tar.xz" "$ALL" || exit 3
  fi
fi
for b in gpu_bench make_synthetic_checkpoint router speculator_service \
         target_service client; do
  if [ ! -x "$ALL/bin/$b" ]; then
    echo "device_session: $ALL/bin/$b missing" >&2
    exit 3
  fi
done
while read -r t; do
  [ -x "$ALL/bin/$t" ] || { echo "device_session: test $t missing" >&2; exit 3; }
done < "$ALL/tests.txt"
export BUNDLE="$ALL" STACK="$ALL"

# A dry run pretends each phase takes all its time (DRY_SPENT), so the
# plan it prints shows which phases a real session would reach.
DRY_SPENT=0
left() { echo $((BUDGET_S - (SECONDS - T0) - DRY_SPENT)); }

# phase NAME NEED_S CAP_S CMD...: runs CMD (a shell string) in its own
# process group, its output to $RESULTS/NAME.log, for at most min(CAP_S,
# time left - 10 s); skipped when less than NEED_S is left. The whole group
# is stopped at the deadline, so a benchmark's services cannot outlive it.
# Each phase in a process group of its own (setsid, util-linux); where
# there is no setsid, `set -m` gives every background job its own group.
if command -v setsid > /dev/null 2>&1; then
  SETSID=setsid
else
  SETSID=
  set -m
fi
declare -a ROWS=()
FAILED=0
phase() {
  local name=$1 need=$2 cap=$3 cmd=$4 budget rc start pg
  budget=$(( $(left) - 10 ))
  (( budget > cap )) && budget=$cap
  if (( budget < need )); then
    echo "device_session: $name skipped: ${budget} s left, needs $need" >&2
    ROWS+=("| $name | skipped (time) | 0 |")
    return 0
  fi
  if [ "$DRY" = 1 ]; then
    echo "device_session: would run $name (up to ${budget} s): $cmd"
    ROWS+=("| $name | dry run | $budget |")
    DRY_SPENT=$((DRY_SPENT + budget))
    return 0
  fi
  echo "device_session: $name (up to ${budget} s)" >&2
  start=$SECONDS
  $SETSID bash -c "$cmd" > "$RESULTS/$name.log" 2>&1 < /dev/null &
  pg=$!
  RUNNING=$pg
  while kill -0 "$pg" 2>/dev/null && (( SECONDS - start < budget )); do
    sleep 1
  done
  if kill -0 "$pg" 2>/dev/null; then
    kill -TERM -- "-$pg" 2>/dev/null
    sleep 5
    kill -KILL -- "-$pg" 2>/dev/null
    wait "$pg" 2>/dev/null
    rc=timeout
  else
    wait "$pg"
    rc=$?
  fi
  RUNNING=
  [ "$rc" = 0 ] || FAILED=1
  ROWS+=("| $name | $([ "$rc" = 0 ] && echo passed || echo "failed ($rc)") | $((SECONDS - start)) |")
  echo "device_session: $name: exit $rc after $((SECONDS - start)) s" >&2
  pack
}
# A stop of the whole call (the device tool's limit) stops every phase.
RUNNING=
CK_PID=
trap 'for g in $RUNNING $CK_PID; do kill -KILL -- "-$g" 2>/dev/null; done' EXIT
trap 'exit 143' TERM INT

has() { [[ " $PHASES " == *" $1 "* ]]; }

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm \
  --format=csv > "$RESULTS/gpu_info.txt" 2>&1 || true

# The checkpoints (CPU, disk) are written while the tests use the GPU,
# unless the stack is given its models (SPECULATOR / TARGET).
if [ "$DRY" != 1 ] && [ -z "${TARGET:-}" ] &&
   { has engine || has stack || has torch || has stack_alt; }; then
  $SETSID bash -c "tools/gpu/run_gpu_bench.sh checkpoints" \
    > "$RESULTS/checkpoints.log" 2>&1 < /dev/null &
  CK_PID=$!
fi
has tests && phase tests 30 180 \
  "tools/gpu/run_gpu_tests.sh --gtest_filter='$GPU_FILTER'"
if [ -n "$CK_PID" ]; then
  ck_start=$SECONDS
  while kill -0 "$CK_PID" 2>/dev/null && (( $(left) > 60 )); do sleep 1; done
  if kill -0 "$CK_PID" 2>/dev/null; then
    kill -KILL -- "-$CK_PID" 2>/dev/null
    CK_PID=
    ROWS+=("| checkpoints | failed (time) | $((SECONDS - ck_start)) |")
    FAILED=1
  elif wait "$CK_PID"; then
    CK_PID=
    ROWS+=("| checkpoints | passed | waited $((SECONDS - ck_start)) |")
  else
    CK_PID=
    ROWS+=("| checkpoints | failed | waited $((SECONDS - ck_start)) |")
    FAILED=1
  fi
fi
has engine && phase engine 90 240 \
  "RESULTS_DIR='$RESULTS' tools/gpu/run_gpu_bench.sh engine ${ENGINE_ARGS:-}"
# The stack's prefill attention, unless STACK_ATTENTION names one: the
# services' default (auto: each times the kernels at start-up and keeps the
# fastest that agrees) once TunePrefillAttention has passed its GPU test,
# or when no tests phase ran it (a narrower GPU_FILTER: nothing speaks
# against the default); where it ran and did not pass (failed, or skipped
# without a GPU), the path the engine benchmark found fastest among those
# whose logits agree with the default's (gpu_bench: "prefill attention for
# the rest of the N row: PATH", the longest prompt's line); else flash.
path=${STACK_ATTENTION:-}
why="STACK_ATTENTION"
if [ -z "$path" ]; then
  if grep -q '^\[       OK \] CudaTest.TunePrefillAttention' \
       "$RESULTS/tests.log" 2>/dev/null; then
    path=auto
    why="tuned by each service at start-up (its GPU test passed)"
  elif ! grep -q '^\[ RUN      \] CudaTest.TunePrefillAttention' \
         "$RESULTS/tests.log" 2>/dev/null; then
    path=auto
    why="the services' default (its GPU test did not run)"
  fi
fi
if [ -z "$path" ] && [ -s "$RESULTS/engine.log" ]; then
  path=$(sed -n 's/^prefill attention for the rest of the [0-9]* row: \([a-z]*\)$/\1/p' \
    "$RESULTS/engine.log" | tail -1)
  why="the engine benchmark's pick"
fi
if [ -z "$path" ]; then
  path=flash
  why="the tuning test did not pass and no engine pick"
fi
echo "device_session: the stack's prefill attention: $path ($why)" >&2
stack_args="--prefill_attention=$path"
has stack && phase stack 120 330 \
  "LOGS='$RESULTS/stack_logs' LENGTHS='$STACK_LENGTHS' REPS=1 STREAM_REQUESTS=1 SERVICE_ARGS='$stack_args' tools/gpu/run_stack_bench.sh"
has torch && phase torch 60 240 \
  "RESULTS_DIR='$RESULTS' tools/gpu/run_gpu_bench.sh torch"
has stack_alt && phase stack_alt 60 200 \
  "LOGS='$RESULTS/stack_alt_logs' LENGTHS='$STACK_ALT_LENGTHS' REPS=1 STREAMS=64 STREAM_REQUESTS=1 CHECKS=0 ANCHOR=off SERVICE_ARGS='$stack_args $STACK_ALT_ARGS' tools/gpu/run_stack_bench.sh"
has suite && phase suite 60 300 \
  "tools/gpu/run_gpu_tests.sh --gtest_filter='-$GPU_FILTER'"

{
  echo "# Device session, $(date -u +%Y-%m-%dT%H:%MZ), $(($SECONDS - T0)) s"
  echo
  echo "GPU: $(tail -n +2 "$RESULTS/gpu_info.txt" 2>/dev/null | head -1)"
  echo
  echo "Stack prefill attention: $path ($why); service flags: $stack_args"
  # Each service's start-up line: the kept kernel and every trial's time.
  grep -h '^prefill attention:' "$RESULTS"/stack_logs/*.log 2>/dev/null |
    sed 's/^/    /' || true
  # cuDNN plans built after start-up (in requests), each service's total.
  for f in "$RESULTS"/stack_logs/*_service.log; do
    [ -e "$f" ] || continue
    last=$(grep '^cudnn plan ' "$f" | tail -1)
    if [ -n "$last" ]; then echo "    $(basename "$f" .log): $last"; fi
  done
  # The batched (decode / verify) attention kernel over long contexts.
  grep -h '^batched attention D=' "$RESULTS/tests.log" 2>/dev/null |
    sed 's/^/    /' || true
  echo
  echo "| phase | status | s |"
  echo "|---|---|---|"
  printf '%s\n' "${ROWS[@]}"
  for f in tests suite; do
    [ -s "$RESULTS/$f.log" ] || continue
    echo
    echo "## $f: failed tests"
    echo
    grep -E '^\[  FAILED  \]|exited [0-9]' "$RESULTS/$f.log" | sort -u ||
      echo "none listed (a timed-out phase lists none: see $f.log)"
  done
  if [ -s "$RESULTS/engine.log" ]; then
    echo
    echo "## engine"
    echo
    # Its lines per length (prefill paths, chunked prefills as the services
    # run them, phase times), then its main table (scoring, kept prefill,
    # TTFT per keep).
    grep -E '^(cuBLAS .* GEMM |target .* loaded in|(target|speculator) (start-up|decode GEMM) tuning:|target full prefill at|prefill attention for the rest|(mma|cudnn) at [0-9]+:|speculator prefill at|target kept prefill at|phases of )' \
      "$RESULTS/engine.log" || true
    # The projections' GEMM MFU: as the forward calls them / 16-bit output.
    sed -n '/^GEMM MFU/,/^$/p' "$RESULTS/engine.log" | sed '/^$/d'
    grep -E '^prompt +full_s|^[0-9]+ +[0-9]+\.[0-9]{4} +[0-9]+\.[0-9]{4} +[0-9]+\.[0-9]{2} ' \
      "$RESULTS/engine.log" || true
    # The batched decode table: its title, header and one line per B.
    sed -n '/^batched decode of the target/,/^$/p' "$RESULTS/engine.log" |
      sed '/^$/d; /^phases of /d'
  fi
  [ -s "$RESULTS/stack.log" ] && { echo; echo "## stack"; echo; grep -E '^\||^(Concurrent|Anchor|stack_checks)|^$' "$RESULTS/stack.log" | cat -s; }
  [ -s "$RESULTS/stack_alt.log" ] && { echo; echo "## stack with $STACK_ALT_ARGS"; echo; grep -E '^\||^Concurrent|^$' "$RESULTS/stack_alt.log" | cat -s; }
} > "$SUMMARY"
pack
cat "$SUMMARY"
exit "$FAILED"

#!/usr/bin/env bash
# Runs one fuzz target on a writable copy of its checked-in corpus.
#   run_fuzz.sh BINARY CORPUS_DIR SECONDS RUNS
# libFuzzer build (--config=fuzz): fuzzes for SECONDS; new inputs land in
# the copy ($TEST_UNDECLARED_OUTPUTS_DIR keeps crash artifacts). Default
# build: the stand-in driver replays the corpus and RUNS mutations.
set -euo pipefail
bin="$1" corpus="$2" seconds="$3" runs="$4"
work="${TEST_TMPDIR:-$(mktemp -d)}/corpus"
artifacts="${TEST_UNDECLARED_OUTPUTS_DIR:-$work/..}/"
mkdir -p "$work"
cp -L "$corpus"/* "$work/"
exec "$bin" -max_total_time="$seconds" -runs_if_no_libfuzzer="$runs" \
  -artifact_prefix="$artifacts" -rss_limit_mb=4096 -timeout=10 \
  -print_final_stats=1 "$work"

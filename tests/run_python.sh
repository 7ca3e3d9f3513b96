#!/usr/bin/env bash
# Bazel sh_test wrapper: Debian's python3 (with python3-grpcio) runs the
# test script given as $1 from the runfiles root.
# Under --config=tsan / --config=asan (.bazelrc sets TSAN_OPTIONS,
# ASAN_OPTIONS, UBSAN_OPTIONS) every binary the test starts (the services,
# the clients) writes any sanitizer report to a file, as in e2e_test.sh: a
# service's report, also one made while it shuts down (LeakSanitizer's at
# exit), would otherwise vanish with its stderr. Any report fails the test.
set -euo pipefail
reports="${TEST_TMPDIR:-$(mktemp -d)}"
for var in TSAN_OPTIONS ASAN_OPTIONS UBSAN_OPTIONS; do
  if [[ -n "${!var:-}" ]]; then
    export "${var}=${!var}:log_path=${reports}/${var%%_*}"
  fi
done
status=0
/usr/bin/python3 "$@" || status=$?
for report in "${reports}"/{TSAN,ASAN,UBSAN}.*; do
  [[ -e "${report}" ]] || continue
  echo "Sanitizer report (${report}):" >&2
  cat "${report}" >&2
  status=1
done
exit "${status}"

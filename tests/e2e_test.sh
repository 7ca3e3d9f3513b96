#!/usr/bin/env bash
# Bazel sh_test wrapper: Debian's python3 (with python3-grpcio) runs the
# end-to-end tests from the runfiles root.
set -euo pipefail
# Under --config=tsan and --config=asan (.bazelrc sets TSAN_OPTIONS,
# ASAN_OPTIONS and UBSAN_OPTIONS) the services write any sanitizer report
# to a file: ThreadSanitizer's, AddressSanitizer's, UBSan's, and
# LeakSanitizer's at exit. One found while a service shuts down, after the
# last request was answered, would otherwise go unnoticed with its stderr.
# Any report fails the test.
for var in TSAN_OPTIONS ASAN_OPTIONS UBSAN_OPTIONS; do
  if [[ -n "${!var:-}" ]]; then
    export "${var}=${!var}:log_path=${TEST_TMPDIR}/${var%%_*}"
  fi
done
status=0
/usr/bin/python3 tests/e2e_test.py "$@" || status=$?
for report in "${TEST_TMPDIR}"/{TSAN,ASAN,UBSAN}.*; do
  [[ -e "${report}" ]] || continue
  echo "Sanitizer report from a service (${report}):" >&2
  cat "${report}" >&2
  status=1
done
exit "${status}"

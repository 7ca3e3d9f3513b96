#!/usr/bin/env bash
# Bazel sh_test wrapper: Debian's python3 (with python3-grpcio) runs the
# end-to-end tests from the runfiles root.
set -euo pipefail
# Under --config=tsan (.bazelrc sets TSAN_OPTIONS) the services write any
# ThreadSanitizer report to a file: one found while a service shuts down,
# after the last request was answered, would otherwise go unnoticed. Any
# report fails the test.
if [[ -n "${TSAN_OPTIONS:-}" ]]; then
  export TSAN_OPTIONS="${TSAN_OPTIONS}:log_path=${TEST_TMPDIR}/tsan"
fi
status=0
/usr/bin/python3 tests/e2e_test.py "$@" || status=$?
for report in "${TEST_TMPDIR}"/tsan.*; do
  [[ -e "${report}" ]] || continue
  echo "ThreadSanitizer report from a service (${report}):" >&2
  cat "${report}" >&2
  status=1
done
exit "${status}"

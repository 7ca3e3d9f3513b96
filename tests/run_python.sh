#!/usr/bin/env bash
# Bazel sh_test wrapper: Debian's python3 (with python3-grpcio) runs the
# test script given as $1 from the runfiles root.
# Under --config=tsan (.bazelrc sets TSAN_OPTIONS) every binary the test
# starts (the services, the clients) writes any ThreadSanitizer report to a
# file, as in e2e_test.sh: a service's report, also one made while it shuts
# down, would otherwise vanish with its stderr. Any report fails the test.
set -euo pipefail
reports="${TEST_TMPDIR:-$(mktemp -d)}"
if [[ -n "${TSAN_OPTIONS:-}" ]]; then
  export TSAN_OPTIONS="${TSAN_OPTIONS}:log_path=${reports}/tsan"
fi
status=0
/usr/bin/python3 "$@" || status=$?
for report in "${reports}"/tsan.*; do
  [[ -e "${report}" ]] || continue
  echo "ThreadSanitizer report (${report}):" >&2
  cat "${report}" >&2
  status=1
done
exit "${status}"

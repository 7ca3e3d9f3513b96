#!/usr/bin/env bash
# Prints the N slowest test targets from `bazel test` output (its summary
# lines "//pkg:target  PASSED in 12.3s"; for a sharded target Bazel prints
# the slowest shard's time), slowest first, with their status.
# Usage: tools/slowest_tests.sh LOG [N]   (N defaults to 15)
set -euo pipefail
log=$1
n=${2:-15}
grep -E '^//[^ ]+ +(\(cached\) )?(PASSED|FAILED|FLAKY|TIMEOUT).* in [0-9.]+s$' "$log" |
  sed -E 's/^(\/\/[^ ]+) +(\(cached\) )?([A-Z]+).* in ([0-9.]+)s$/\4 \3 \1 \2/' |
  sort -rn | head -n "$n" |
  awk '{ printf "%8.1f s  %-8s %s %s\n", $1, $2, $3, $4 }' || true

#!/usr/bin/env bash
# Regenerates bench/results/: eval_results.json, eval_results.md and the PNG
# plots (fidelity vs baselines, ablations, in-process speed).
# About 2.5 minutes on the 2-core dev machine. Plotting needs gnuplot
# (Debian: apt-get install gnuplot-nox); the CI smoke test does not.
#   bench/run_eval.sh [extra eval_fidelity flags, e.g. --synthetic=false]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=bench/results
bazel build //bench:eval_fidelity
bazel-bin/bench/eval_fidelity --out_dir "$OUT" "$@"
if command -v gnuplot > /dev/null; then
  python3 bench/plot_eval.py "$OUT/eval_results.json" "$OUT"
else
  echo "gnuplot not found (apt-get install gnuplot-nox): plots skipped" >&2
fi

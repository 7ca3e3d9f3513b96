#!/usr/bin/env bash
# Regenerates bench/results/retrieval_results.{json,md} and the plot:
# long-range retrieval accuracy of Speculative Prefill vs
# keep-recent, sink+recent and random drop, and keep-by-mass vs fixed keep
# ratios. The prompts come from bench/make_retrieval_prompts.py with fixed
# seeds (one file per target tokenizer and distance band, in /tmp); the
# prompts each pair counted are written to bench/data/. ~10 minutes on 2
# cores. Plotting needs gnuplot (apt-get install gnuplot-nox).
#   bench/run_retrieval_eval.sh [extra eval_retrieval flags]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=bench/results
GEN=/tmp/specserve_retrieval
mkdir -p "$GEN"
gen() {  # target band count min_words max_words seed
  /usr/bin/python3 bench/make_retrieval_prompts.py --out "$GEN/$1_$2.jsonl" \
    --count "$3" --min_words "$4" --max_words "$5" --seed "$6"
}
# Filler words per band: stories260K's 512-piece tokenizer takes ~2.6 tokens
# per word, tinystories-656K's ~1.2, so the bands differ in words; the
# evaluation reports the fact-to-cue distance in tokens it measured.
gen stories260K short 2000 10 20 161
gen stories260K medium 3000 50 60 162
gen stories260K long 6000 100 125 163
gen tinystories-656K short 2000 25 35 164
gen tinystories-656K medium 3000 100 125 165
gen tinystories-656K long 6000 220 260 166
bazel build -c opt //bench:eval_retrieval
bazel-bin/bench/eval_retrieval --prompts "$GEN/{target}_{band}.jsonl" \
  --counted_out "bench/data/retrieval_counted_{target}_{band}.jsonl" \
  --out_dir "$OUT" "$@"
if command -v gnuplot > /dev/null; then
  /usr/bin/python3 bench/plot_retrieval.py "$OUT/retrieval_results.json" "$OUT"
else
  echo "gnuplot not found (apt-get install gnuplot-nox): plot skipped" >&2
fi

#!/usr/bin/env python3
"""Renders retrieval_<pair>.png from retrieval_results.json with gnuplot:
accuracy (with Wilson 95% intervals) vs keep ratio for each distance band,
Speculative Prefill against the baselines at the same kept count.

    python3 bench/plot_retrieval.py bench/results/retrieval_results.json \
        bench/results

Needs only the standard library and the `gnuplot` binary (gnuplot-nox).
"""
import json
import subprocess
import sys

METHODS = [("specprefill_c8_la8", "SpecPrefill chunk 8, look-ahead 8"),
           ("specprefill_c8_la0", "SpecPrefill chunk 8, look-ahead 0"),
           ("specprefill_c32_la8", "SpecPrefill chunk 32, look-ahead 8"),
           ("recent_c8", "keep recent (count of chunk 8)"),
           ("sink_recent_c8", "sink 4 + recent (count of chunk 8)"),
           ("random_c8", "random drop (count of chunk 8)")]


def safe(s):
    return "".join(c if c.isalnum() else "_" for c in s)


def main():
    src, out_dir = sys.argv[1], sys.argv[2]
    with open(src) as f:
        j = json.load(f)
    for pair, r in j["pairs"].items():
        bands = list(r["retrieval"].items())
        script = ""
        for bi, (band, ret) in enumerate(bands):
            for mi, (m, _) in enumerate(METHODS):
                rows = ret["methods"].get(m, {}).get("by_ratio", [])
                body = "\n".join(
                    f"{x:.3f} {100 * c['accuracy']:.3f} "
                    f"{100 * c['ci95'][0]:.3f} {100 * c['ci95'][1]:.3f}"
                    for x, c in zip(ret["ratios"], rows))
                script += f"$d{bi}_{mi} << EOD\n{body}\nEOD\n"
        script += (f"set terminal pngcairo size {500 * len(bands)},450 "
                   f"font ',10'\nset output '{out_dir}/retrieval_"
                   f"{safe(pair)}.png'\nset multiplot layout 1,"
                   f"{len(bands)} title 'Retrieval accuracy, {pair}'\n"
                   "set xlabel 'keep ratio'\nset ylabel 'accuracy (%)'\n"
                   "set yrange [0:105]\nset key top left font ',8'\n"
                   "set grid\n")
        for bi, (band, ret) in enumerate(bands):
            dist = ret["fact_to_cue_tokens"]["mean"]
            script += (f"set title '{band}: fact {dist:.0f} tokens back, "
                       f"n = {ret['counted']}'\nplot ")
            script += ", ".join(
                f"$d{bi}_{mi} using 1:2:3:4 with yerrorlines title '{label}'"
                for mi, (_, label) in enumerate(METHODS)) + "\n"
        script += "unset multiplot\n"
        subprocess.run(["gnuplot"], input=script.encode(), check=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Renders the PNG plots of bench/results/ from eval_results.json with gnuplot.

    python3 bench/plot_eval.py bench/results/eval_results.json bench/results

Writes fidelity_<pair>.png (top-1 / KL / match vs keep ratio, every pruning
method), ttft_speedup.png (TTFT speedup vs keep ratio per pair and prompt
length) and speculative_decoding.png (mean acceptance length and decode
speedup vs k). Needs only the standard library and the `gnuplot` binary
(Debian: gnuplot-nox).
"""
import json
import os
import shutil
import subprocess
import sys

METHODS = [("specprefill", "SpecPrefill (chunk 32)"),
           ("specprefill_chunk8", "SpecPrefill (chunk 8)"),
           ("random", "random drop (3 seeds, +-std)"),
           ("recent", "keep recent"),
           ("sink_recent", "sink 4 + recent")]
METRICS = [("top1_agreement", "top-1 agreement"),
           ("kl_mean", "mean KL(full || pruned), nats"),
           ("match_rate", "32-token greedy match rate")]


def datablock(name, rows):
    """A gnuplot inline data block named $name from rows of numbers."""
    body = "\n".join(" ".join(f"{v:.6g}" for v in r) for r in rows)
    return f"${name} << EOD\n{body}\nEOD\n"


def safe(s):
    return "".join(c if c.isalnum() else "_" for c in s)


def fidelity_plot(j, pair, out_dir):
    rows = [r for r in j["fidelity"] if r["pair"] == pair]
    script, n = "", 0
    for m, _ in METHODS:
        for key, _ in METRICS:
            pts = sorted((r["keep_ratio"], r[key], r.get(key + "_seed_std", 0))
                         for r in rows if r["method"] == m)
            script += datablock(f"{m}_{key}", pts)
    r0 = rows[0]
    script += (
        f"set terminal pngcairo size 1500,480 font ',10'\n"
        f"set output '{out_dir}/fidelity_{safe(pair)}.png'\n"
        f"set multiplot layout 1,3 title "
        f"'{r0['scorer']} -> {r0['target']}: pruned vs full prompt "
        f"({r0['prompts']} prompts; baselines keep as many tokens as "
        f"SpecPrefill chunk 32)'\n"
        "set xlabel 'keep ratio'\nset grid\nset key bottom right\n"
        "set xrange [0:1]\n")
    for key, label in METRICS:
        script += f"set ylabel '{label}'\n"
        corner = {"kl_mean": "top right", "match_rate": "top left"}
        script += f"set key {corner.get(key, 'bottom right')}\n"
        plots = []
        for i, (m, mlabel) in enumerate(METHODS):
            if m == "random":
                plots.append(f"${m}_{key} using 1:2:3 with yerrorlines lw 2 "
                             f"lc {i + 1} title '{mlabel}'")
            else:
                plots.append(f"${m}_{key} using 1:2 with linespoints lw 2 "
                             f"lc {i + 1} title '{mlabel}'")
        script += "plot " + ", \\\n  ".join(plots) + "\n"
        n += 1
    script += "unset multiplot\n"
    return script


def ttft_plot(j, out_dir):
    rows = j["speed"]["ttft"]
    series = sorted({(r["pair"], r["prompt_tokens"]) for r in rows})
    script, plots = "", []
    for i, (pair, n) in enumerate(series):
        pts = sorted((r["keep_ratio"], r["speedup"]) for r in rows
                     if r["pair"] == pair and r["prompt_tokens"] == n)
        name = f"t{i}"
        script += datablock(name, pts)
        plots.append(f"${name} using 1:2 with linespoints lw 2 "
                     f"title '{pair}, {n} tokens'")
    script += (
        f"set terminal pngcairo size 900,600 font ',10'\n"
        f"set output '{out_dir}/ttft_speedup.png'\n"
        "set title 'TTFT speedup of Speculative Prefill (in process): full "
        "prefill / (scoring + kept prefill)'\n"
        "set xlabel 'keep ratio'\nset ylabel 'speedup (x)'\nset grid\n"
        "set key top right\nset xrange [0:1]\nset yrange [0:*]\n"
        "plot 1 with lines dt 2 lc 'black' title 'no speedup', \\\n  "
        + ", \\\n  ".join(plots) + "\n")
    return script


def decode_plot(j, out_dir):
    rows = j["speed"]["decode"]
    pairs = sorted({r["pair"] for r in rows})
    script = ""
    for i, pair in enumerate(pairs):
        pts = sorted((r["k"], r.get("mean_acceptance_length", 1),
                      r["speedup_vs_no_sd"]) for r in rows
                     if r["pair"] == pair)
        script += datablock(f"d{i}", pts)
    script += (
        f"set terminal pngcairo size 1200,480 font ',10'\n"
        f"set output '{out_dir}/speculative_decoding.png'\n"
        "set multiplot layout 1,2 title 'Speculative decoding, greedy "
        "(draft = the scorer of each pair)'\n"
        "set xlabel 'draft tokens per round k'\nset grid\nset key top left\n"
        "set xtics (0, 2, 4, 8)\nset xrange [-0.5:8.5]\n"
        "set ylabel 'mean acceptance length (tokens per target call)'\n"
        "plot x + 1 with lines dt 2 lc 'black' title 'all accepted (k+1)', "
        + ", ".join(f"$d{i} using 1:2 with linespoints lw 2 title '{p}'"
                    for i, p in enumerate(pairs)) + "\n"
        "set ylabel 'decode tokens/s vs target alone (x)'\nset key top right\n"
        "set yrange [0:*]\n"
        "plot 1 with lines dt 2 lc 'black' title 'target alone', "
        + ", ".join(f"$d{i} using 1:3 with linespoints lw 2 title '{p}'"
                    for i, p in enumerate(pairs)) + "\n"
        "unset multiplot\n")
    return script


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    src, out_dir = sys.argv[1], sys.argv[2]
    if not shutil.which("gnuplot"):
        sys.exit("gnuplot not found: apt-get install gnuplot-nox")
    j = json.load(open(src))
    os.makedirs(out_dir, exist_ok=True)
    scripts = [fidelity_plot(j, p["pair"], out_dir) for p in j["prompts"]]
    if "speed" in j:
        scripts += [ttft_plot(j, out_dir), decode_plot(j, out_dir)]
    for s in scripts:
        subprocess.run(["gnuplot"], input=s, text=True, check=True)
    print("plots written to", out_dir)


if __name__ == "__main__":
    main()

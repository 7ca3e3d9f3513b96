#!/usr/bin/env python3
"""Closed-loop load through the router's OpenAI HTTP API, standard library
only (the GPU machine has no gRPC Python): at each concurrency level, N
streams each send requests back to back to /v1/completions with a prompt of
random token ids, `ignore_eos`, and Speculative Prefill and speculative
decoding off unless --spec; prints a Markdown table of output tokens/s (all
streams), its ratio to the first level, requests, and failures.

  tools/gpu/http_load.py --url http://127.0.0.1:8000 --vocab 128256 \
      [--streams 1,16,64,128] [--prompt_tokens 256] [--new_tokens 128] \
      [--requests_per_stream 2] [--spec] \
      [--target_metrics http://127.0.0.1:9092/metrics]

With --target_metrics (the target service's Prometheus endpoint), each
level also reports what the target's scheduler did meanwhile: forwards,
sequences and rows per forward, the mean forward time, the mean host gap
between back-to-back forwards (specserve_target_step_gap_seconds) and the
share of the level's wall time spent in forwards. Output tokens/s well
below the engine's batched decode with a busy share near 100% means the
forwards are slow; a low share means host time between them.

Exit status 1 if any request failed.
"""

import argparse
import json
import random
import sys
import threading
import time
import urllib.error
import urllib.request


def completion(url, body, timeout):
    """POSTs one /v1/completions request; its usage.completion_tokens."""
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)["usage"]["completion_tokens"]


TARGET_SERIES = (
    "specserve_target_forward_seconds_sum",
    "specserve_target_forward_seconds_count",
    "specserve_target_step_gap_seconds_sum",
    "specserve_target_step_gap_seconds_count",
    "specserve_target_batch_sequences_sum",
    "specserve_target_batch_tokens_sum",
)


def scrape(url):
    """The TARGET_SERIES values at a Prometheus text endpoint ({} on error)."""
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError) as e:
        print("  metrics: %s" % e, file=sys.stderr)
        return {}
    values = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in TARGET_SERIES:
            values[parts[0]] = float(parts[1])
    return values


def step_columns(before, after, secs):
    """The scheduler's columns for one level from two scrapes."""
    if not before or not after:
        return " | | | | | |"
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in TARGET_SERIES}
    forwards = d["specserve_target_forward_seconds_count"]
    gaps = d["specserve_target_step_gap_seconds_count"]
    per = lambda k, n: d[k] / n if n else 0.0
    return " %d | %.1f | %.0f | %.2f | %.2f | %.0f%% |" % (
        forwards,
        per("specserve_target_batch_sequences_sum", forwards),
        per("specserve_target_batch_tokens_sum", forwards),
        1e3 * per("specserve_target_forward_seconds_sum", forwards),
        1e3 * per("specserve_target_step_gap_seconds_sum", gaps),
        100.0 * d["specserve_target_forward_seconds_sum"] / max(secs, 1e-9))


def run_level(a, streams):
    """`streams` threads, each sending a.requests_per_stream requests."""
    lock = threading.Lock()
    done = {"tokens": 0, "requests": 0, "failed": 0, "error": ""}

    def stream(s):
        rng = random.Random(1000 * streams + s)
        for _ in range(a.requests_per_stream):
            body = {  # no "model": the router then serves its own
                "prompt": [rng.randrange(3, a.vocab)
                           for _ in range(a.prompt_tokens)],
                "max_tokens": a.new_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            if not a.spec:
                body["speculative_prefill"] = {"enabled": False}
                body["speculative_decoding"] = {"enabled": False}
            try:
                n = completion(a.url, body, a.timeout)
                with lock:
                    done["tokens"] += n
                    done["requests"] += 1
            except (urllib.error.URLError, OSError, ValueError, KeyError) as e:
                with lock:
                    done["failed"] += 1
                    done["error"] = str(e)

    threads = [threading.Thread(target=stream, args=(s,))
               for s in range(streams)]
    t0 = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done["secs"] = time.time() - t0
    return done


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="router HTTP base URL")
    ap.add_argument("--vocab", type=int, required=True,
                    help="the target's vocab_size (ids are drawn below it)")
    ap.add_argument("--streams", default="1,16,64,128")
    ap.add_argument("--prompt_tokens", type=int, default=256)
    ap.add_argument("--new_tokens", type=int, default=128)
    ap.add_argument("--requests_per_stream", type=int, default=2)
    ap.add_argument("--spec", action="store_true",
                    help="leave Speculative Prefill and decoding to the "
                         "router's defaults")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--target_metrics", default="",
                    help="the target's /metrics URL: adds its scheduler's "
                         "forwards, batch sizes, forward and gap times")
    a = ap.parse_args()
    head = "| concurrent streams | output tok/s | x first level | requests " \
           "| failed |"
    rule = "|---|---|---|---|---|"
    if a.target_metrics:
        head += " forwards | seqs/forward | rows/forward | forward ms " \
                "| gap ms | in forwards |"
        rule += "---|---|---|---|---|---|"
    print(head)
    print(rule)
    first = None
    failed = 0
    for n in [int(x) for x in a.streams.split(",") if x]:
        before = scrape(a.target_metrics) if a.target_metrics else None
        r = run_level(a, n)
        after = scrape(a.target_metrics) if a.target_metrics else None
        rate = r["tokens"] / max(r["secs"], 1e-9)
        first = first or rate
        failed += r["failed"]
        row = "| %d | %.1f | %.1fx | %d | %d |" % (
            n, rate, rate / first if first else 0.0, r["requests"],
            r["failed"])
        if a.target_metrics:
            row += step_columns(before, after, r["secs"])
        print(row, flush=True)
        if r["failed"]:
            print("  last error: %s" % r["error"], file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

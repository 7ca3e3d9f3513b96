#!/usr/bin/env python3
"""Serving benchmark: a closed-loop load generator through the router
against the real binaries (router -> speculator, target on loopback) at
several concurrency levels. Each of C clients sends requests back to back;
reported per level: output tokens/s and requests/s (all clients), TTFT and
TPOT p50 / p99 (from each response's stats), failed requests, the mean
batch each service's scheduler formed (sessions per batched forward, from
their Prometheus histograms) and the target's mean batched forward per
decode / verify round (specserve_target_round_seconds): TPOT minus that is
what the serving path adds per token.

    bazel run -c opt //bench:serving_bench -- [--pairs bundled,synthetic]
        [--concurrency 1,4,16,64,256] [--requests_per_client 2]
    (or /usr/bin/python3 bench/serving_bench.py ... after building)

Modes: "spec" = Speculative Prefill (keep 0.3) + speculative decoding
(k = 4); "plain" = full prefill, no drafts. The synthetic pair is
llama2-15m -> llama2-110m with random weights (token-id prompts).
"""

import argparse
import os
import random
import sys
import threading
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(REPO, "tests"))
sys.path.insert(0, os.path.join(REPO, "tools", "python"))
sys.path.insert(0, os.path.join(REPO, "bench"))
os.chdir(REPO)
import grpc  # noqa: E402
import specserve_client  # noqa: E402
from e2e_bench import synthetic, tokenize  # noqa: E402
from stack import Stack  # noqa: E402

pb, pb_grpc = specserve_client.load_stubs()


def pct(values, p):
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(round(p / 100.0 * (len(v) - 1))))]


def hist(service, name):
    return (service.metric_value(name + "_sum") or 0.0,
            service.metric_value(name + "_count") or 0.0)


def run_level(stub, prompts, concurrency, per_client, mode, max_new):
    """C clients, each sending `per_client` requests back to back."""
    lock = threading.Lock()
    ttft, tpot, tokens, failures = [], [], [0], {}

    def client(c):
        rng = random.Random(c)
        for _ in range(per_client):
            ids = prompts[rng.randrange(len(prompts))]
            spec = mode == "spec"
            req = specserve_client.build_request(
                pb, token_ids=ids, max_new_tokens=max_new, temperature=0.0,
                spec_prefill=spec, keep_ratio=0.3 if spec else None,
                spec_decode=spec, num_draft_tokens=4 if spec else None)
            req.sampling.ignore_eos = True
            try:
                r = stub.Generate(req, timeout=600)
            except grpc.RpcError as e:
                with lock:
                    failures[e.code().name] = failures.get(e.code().name, 0) + 1
                continue
            n = r.usage.completion_tokens
            with lock:
                tokens[0] += n
                ttft.append(r.stats.ttft_s)
                if n > 1:
                    tpot.append((r.stats.total_s - r.stats.ttft_s) / (n - 1))

    threads = [threading.Thread(target=client, args=(c,))
               for c in range(concurrency)]
    t0 = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.time() - t0
    return dict(wall=wall, tokens=tokens[0], requests=len(ttft),
                failures=failures, ttft=ttft, tpot=tpot)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", default="bundled,synthetic")
    ap.add_argument("--modes", default="spec,plain")
    ap.add_argument("--concurrency", default="1,4,16,64,256")
    ap.add_argument("--requests_per_client", type=int, default=2)
    ap.add_argument("--min_requests", type=int, default=8,
                    help="at least this many requests per level")
    ap.add_argument("--max_new_tokens", type=int, default=32)
    ap.add_argument("--synthetic_prompt_tokens", type=int, default=512)
    ap.add_argument("--router_args", default="",
                    help="extra router flags, e.g. "
                         "--spec_decode_disable_by_batch_size=8")
    a = ap.parse_args()
    print("| pair | mode | clients | output tok/s | req/s | TTFT p50 / p99 s | "
          "TPOT p50 / p99 ms | failed | target batch | speculator batch | "
          "target forward ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for pair in a.pairs.split(","):
        if pair == "bundled":
            spec_m, tgt_m, tok = ("models/stories260K-draft",
                                  "models/stories260K", "models/stories260K")
            text = open("tests/data/golden/prompts/written_lucy_cat_long.txt").read()
            story = tokenize(text)
            # Several prompts: 150-400 tokens of the story.
            prompts = [story[:n] for n in (150, 250, 300, 400)]
        else:
            spec_m, tgt_m, tok = (synthetic("llama2-15m"),
                                  synthetic("llama2-110m"), "")
            rng = random.Random(0)
            n = a.synthetic_prompt_tokens
            prompts = [[1] + [rng.randrange(3, 32000) for _ in range(n - 1)]
                       for _ in range(4)]
        with Stack(speculator_model=spec_m, target_model=tgt_m,
                   tokenizer=tok, router_args=a.router_args.split()) as st:
            stub = pb_grpc.RouterStub(grpc.insecure_channel(
                st.router.address,
                options=[("grpc.max_concurrent_streams", 1024)]))
            for mode in a.modes.split(","):
                for c in [int(x) for x in a.concurrency.split(",")]:
                    per = max(a.requests_per_client, -(-a.min_requests // c))
                    tb = hist(st.target, "specserve_target_batch_sequences")
                    sb = hist(st.speculator, "specserve_speculator_batch_sequences")
                    fb = hist(st.target, "specserve_target_round_seconds")
                    r = run_level(stub, prompts, c, per, mode, a.max_new_tokens)
                    fa = hist(st.target, "specserve_target_round_seconds")
                    ta = hist(st.target, "specserve_target_batch_sequences")
                    sa = hist(st.speculator, "specserve_speculator_batch_sequences")
                    tbatch = (ta[0] - tb[0]) / max(1.0, ta[1] - tb[1])
                    sbatch = (sa[0] - sb[0]) / max(1.0, sa[1] - sb[1])
                    fwd_ms = (fa[0] - fb[0]) / max(1.0, fa[1] - fb[1]) * 1e3
                    failed = sum(r["failures"].values())
                    print("| %s | %s | %d | %.1f | %.2f | %.3f / %.3f | "
                          "%.2f / %.2f | %d%s | %.1f | %.1f | %.2f |" % (
                              pair, mode, c, r["tokens"] / r["wall"],
                              r["requests"] / r["wall"],
                              pct(r["ttft"], 50), pct(r["ttft"], 99),
                              pct(r["tpot"], 50) * 1e3,
                              pct(r["tpot"], 99) * 1e3, failed,
                              (" " + str(r["failures"])) if failed else "",
                              tbatch, sbatch, fwd_ms))
                    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

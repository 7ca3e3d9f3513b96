#!/usr/bin/env python3
"""End-to-end benchmark through the three services (router -> speculator,
target over gRPC on loopback): TTFT and decode tokens/s for Speculative
Prefill off / keep 0.1, 0.3, 0.5 x speculative decoding off / k = 2, 4, 8;
acceptance rate and mean acceptance length; the router's overhead per
verify round (wall time per round minus the target's own verify time and
the speculator's own draft time, read from their Prometheus counters).

    bazel build -c opt //router //speculator_service //target_service \
        //tools:make_synthetic_checkpoint
    bazel run -c opt //bench:e2e_bench -- [--pairs bundled,synthetic] [--reps 3]
    (or /usr/bin/python3 bench/e2e_bench.py ... after building the binaries)

Synthetic pair: llama2-15m -> llama2-110m random weights (written once
under /tmp/specserve_synthetic; the router runs without a tokenizer and
the prompts are token ids). Random weights accept few drafts: that pair
shows costs, the bundled pair shows acceptance.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(REPO, "tests"))
sys.path.insert(0, os.path.join(REPO, "tools", "python"))
os.chdir(REPO)
import grpc  # noqa: E402
import specserve_client  # noqa: E402
from stack import Stack, find_binary  # noqa: E402

pb, pb_grpc = specserve_client.load_stubs()
SYN = os.environ.get("SPECSERVE_SYNTHETIC_DIR", "/tmp/specserve_synthetic")


def synthetic(preset):
    d = os.path.join(SYN, preset)
    if not os.path.exists(os.path.join(d, "model.safetensors")):
        subprocess.check_call([find_binary("tools/make_synthetic_checkpoint"),
                               "--preset", preset, "--out", d])
    return d


def hist_sum(service, name):
    return service.metric_value(name + "_sum") or 0.0


def run_config(stub, stack, ids, spec_prefill, keep, k, max_new, reps):
    """Median TTFT and decode tok/s over `reps` greedy requests."""
    ttfts, rates, stats_all = [], [], []
    for _ in range(reps):
        req = specserve_client.build_request(
            pb, token_ids=ids, max_new_tokens=max_new, temperature=0.0,
            spec_prefill=spec_prefill, keep_ratio=keep if spec_prefill else None,
            spec_decode=k > 0, num_draft_tokens=k if k > 0 else None)
        req.sampling.ignore_eos = True
        resp = stub.Generate(req, timeout=600)
        s = resp.stats
        decode_s = max(1e-9, s.total_s - s.ttft_s)
        ttfts.append(s.ttft_s)
        rates.append(max(0, resp.usage.completion_tokens - 1) / decode_s)
        stats_all.append(resp)
    mid = sorted(range(reps), key=lambda i: ttfts[i])[reps // 2]
    return ttfts[mid], sorted(rates)[reps // 2], stats_all[mid]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", default="bundled,synthetic")
    ap.add_argument("--lengths", default="512,2048")
    ap.add_argument("--keeps", default="off,0.1,0.3,0.5")
    ap.add_argument("--ks", default="0,2,4,8")
    ap.add_argument("--max_new_tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    rng = random.Random(0)
    print("| pair | prompt | spec prefill | k | TTFT s | decode tok/s | kept | "
          "acceptance rate | mean acc. len | router overhead ms/round |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for pair in a.pairs.split(","):
        if pair == "bundled":
            spec_m, tgt_m, tok = ("models/stories260K-draft", "models/stories260K",
                                  "models/stories260K")
            prompt_text = open("tests/data/golden/prompts/written_lucy_cat_long.txt").read()
            lengths = [None]
        else:
            spec_m, tgt_m, tok = synthetic("llama2-15m"), synthetic("llama2-110m"), ""
            lengths = [int(x) for x in a.lengths.split(",")]
        with Stack(speculator_model=spec_m, target_model=tgt_m, tokenizer=tok) as st:
            stub = pb_grpc.RouterStub(grpc.insecure_channel(st.router.address))
            for n in lengths:
                if n is None:
                    # Bundled: a real story, capped to fit the 512 context.
                    ids = tokenize(prompt_text)[:400]
                    n_label = "%d (story)" % len(ids)
                else:
                    # llama2 presets have a 2048-token context: leave room
                    # for the generated tokens and the drafts.
                    n = min(n, 2048 - a.max_new_tokens - 16)
                    ids = [1] + [rng.randrange(3, 32000) for _ in range(n - 1)]
                    n_label = str(n)
                for keep in a.keeps.split(","):
                    sp = keep != "off"
                    for k in [int(x) for x in a.ks.split(",")]:
                        before_v = hist_sum(st.target, "specserve_target_round_seconds")
                        before_d = hist_sum(st.speculator, "specserve_speculator_draft_seconds")
                        ttft, rate, r = run_config(
                            stub, st, ids, sp, float(keep) if sp else None, k,
                            a.max_new_tokens, a.reps)
                        s = r.stats
                        rounds = max(1, s.num_drafts)
                        acc = (s.num_accepted_tokens / s.num_draft_tokens
                               if s.num_draft_tokens else 0.0)
                        own = (hist_sum(st.target, "specserve_target_round_seconds") - before_v
                               + hist_sum(st.speculator, "specserve_speculator_draft_seconds") - before_d)
                        wall = (s.total_s - s.ttft_s) * a.reps
                        overhead = ((wall - own) / (rounds * a.reps) * 1e3) if k > 0 else float("nan")
                        print("| %s | %s | %s | %d | %.4f | %.1f | %d/%d | %.2f | %.2f | %.2f |" % (
                            pair, n_label, keep, k, ttft, rate,
                            r.usage.kept_prompt_tokens, r.usage.prompt_tokens,
                            acc, s.mean_acceptance_length, overhead))
                        sys.stdout.flush()
    return 0


def tokenize(text):
    """Prompt ids as the router tokenises them (BOS + text)."""
    out = subprocess.run([find_binary("tools/tokenize"), "--model",
                          "models/stories260K", "--text", text],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout)["ids"]


if __name__ == "__main__":
    sys.exit(main())

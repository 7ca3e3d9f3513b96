#!/usr/bin/env python3
"""Prompt-lookup ("ngram") drafting on copy-heavy prompts, through the
router against the real binaries (router -> speculator, target on
loopback).

Workloads (--workload):
  repeat   (default) a story told twice: the first sentence of a bundled
           story (tests/data/golden/prompts, bench/eval_prompts), the
           target's own greedy continuation of it, then BOS (the bundled
           models' story delimiter) and the same first sentence again. The
           greedy answer retells the story: it repeats a span of the prompt,
           the workload prompt lookup is for (quoting, editing, extraction).
  natural  a bundled story followed by the first words of one of its own
           sentences. The bundled 260K-parameter models barely copy from
           their context, so their answers seldom repeat the prompt; kept
           to show what prompt lookup does on free text.
Every prompt runs greedy with Speculative Prefill off (the target sees the whole
prompt, so outputs are comparable) under three methods:

    none   speculative decoding disabled (one target forward per token)
    draft  the speculator model drafts k tokens per round
    ngram  prompt lookup proposes up to k tokens per round (in the target
           itself here: the prompt is never pruned)
    draft_tree  the speculator model drafts a token tree

at each concurrency level (clients sending the prompts from one queue).
Reported per method and level: output tokens/s (all clients), tokens per
target forward (completion tokens / target forwards, from the responses'
stats), mean acceptance length, how many outputs are token-identical
to "none" at the same level, draft tokens (verify rows past the first) per
drafted round, and where a round's time goes: the round as a client sees
it (clients x wall / target forwards), the target's mean verify round and
the speculator's mean draft round (their Prometheus histograms). A method
listed more than once (--methods draft,draft_tree,draft_tree,draft: runs
alternated against the box's drift, in one stack) also gets the mean,
standard deviation and range of its output tokens/s. Every prompt is
sent once before the timed runs, so each run finds it in the services'
prefix caches.

    bazel build -c opt //router //speculator_service //target_service \
        //tools:tokenize
    /usr/bin/python3 bench/ngram_eval.py [--num_prompts 100]
        [--concurrency 1,16] [--num_draft_tokens 4]
        [--prompt_lookup_min 5 --prompt_lookup_max 5]
"""

import argparse
import glob
import os
import random
import re
import statistics
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
from e2e_bench import tokenize  # noqa: E402
from stack import Stack  # noqa: E402

pb, pb_grpc = specserve_client.load_stubs()

STORY_GLOBS = ["tests/data/golden/prompts/*.txt", "bench/eval_prompts/*.txt"]
SENTENCE = re.compile(r"[^.!?]+[.!?]+[\"']?")


def copy_prompts(n, max_prompt_tokens, cue_words, seed):
    """`n` prompts: a story (cut to whole sentences within
    max_prompt_tokens) + the first `cue_words` words of one of its
    sentences (not the first), chosen at random."""
    stories = []
    for pattern in STORY_GLOBS:
        for path in sorted(glob.glob(pattern)):
            text = " ".join(open(path).read().split())
            sentences = [s.strip() for s in SENTENCE.findall(text)]
            if len(sentences) >= 3:
                stories.append(sentences)
    rng = random.Random(seed)
    prompts = []
    while len(prompts) < n:
        sentences = stories[len(prompts) % len(stories)]
        # Whole sentences while the prompt fits (checked with the tokenizer).
        keep = len(sentences)
        while keep > 2:
            body = " ".join(sentences[:keep])
            if len(tokenize(body)) + 16 <= max_prompt_tokens:
                break
            keep -= 1
        candidates = [i for i in range(1, keep)
                      if len(sentences[i].split()) > cue_words + 2]
        if not candidates:
            continue
        i = rng.choice(candidates)
        cue = " ".join(sentences[i].split()[:cue_words])
        prompts.append(" ".join(sentences[:keep]) + " " + cue)
    return prompts


def repeat_prompts(stub, n, story_tokens, seed):
    """`n` token-id prompts: S + greedy(S) + S, S = a story's first
    sentence (BOS first), greedy(S) the target's own continuation of up to
    `story_tokens` tokens, cut before its first BOS (story end)."""
    firsts = []
    for pattern in STORY_GLOBS:
        for path in sorted(glob.glob(pattern)):
            text = " ".join(open(path).read().split())
            sentences = SENTENCE.findall(text)
            if sentences:
                firsts.append(sentences[0].strip())
    rng = random.Random(seed)
    rng.shuffle(firsts)
    prompts = []
    for i in range(n):
        first = tokenize(firsts[i % len(firsts)])
        # Later rounds vary the story length, so repeats differ (cycling
        # back to the longest after the fifth).
        length = story_tokens - 40 * ((i // len(firsts)) % 5)
        req = specserve_client.build_request(
            pb, token_ids=first, max_new_tokens=length, temperature=0.0,
            spec_prefill=False, spec_decode=False)
        req.sampling.stop_token_ids.append(1)
        story = list(stub.Generate(req, timeout=600).token_ids)
        prompts.append(first + story + first)
    return prompts


def run(stub, prompts, concurrency, method, a):
    """All prompts through `concurrency` clients; per-prompt results."""
    out = [None] * len(prompts)
    failures = []
    queue = list(range(len(prompts)))
    lock = threading.Lock()

    def client():
        while True:
            with lock:
                if not queue:
                    return
                i = queue.pop()
            text = isinstance(prompts[i], str)
            req = specserve_client.build_request(
                pb, prompt=prompts[i] if text else None,
                token_ids=None if text else prompts[i],
                max_new_tokens=a.max_new_tokens,
                temperature=0.0, spec_prefill=False,
                spec_decode=method != "none",
                num_draft_tokens=a.num_draft_tokens if method != "none" else None,
                spec_decode_method=method if method != "none" else None,
                prompt_lookup_min=a.prompt_lookup_min if method == "ngram" else None,
                prompt_lookup_max=a.prompt_lookup_max if method == "ngram" else None)
            try:
                r = stub.Generate(req, timeout=600)
            except grpc.RpcError as e:
                with lock:
                    failures.append(e.code().name)
                continue
            out[i] = r

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    t0 = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, time.time() - t0, failures


def round_times(st):
    """Sum and count of the target's verify rounds and the speculator's draft
    rounds so far (their Prometheus histograms), seconds."""
    out = {}
    for key, svc, name in (
            ("target_round", st.target, "specserve_target_round_seconds"),
            ("draft", st.speculator, "specserve_speculator_draft_seconds")):
        out[key] = (svc.metric_value(name + "_sum") or 0.0,
                    svc.metric_value(name + "_count") or 0.0)
    return out


def mean_ms(before, after, key):
    """Mean milliseconds per round of `key` between two round_times()."""
    s = after[key][0] - before[key][0]
    n = after[key][1] - before[key][1]
    return "%.3f" % (1e3 * s / n) if n > 0 else "-"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--speculator_model", default="models/stories260K-draft")
    ap.add_argument("--target_model", default="models/stories260K")
    ap.add_argument("--tokenizer", default="models/stories260K")
    ap.add_argument("--workload", choices=["repeat", "natural"],
                    default="repeat")
    ap.add_argument("--story_tokens", type=int, default=200,
                    help="repeat: the longest retold story")
    ap.add_argument("--num_prompts", type=int, default=100)
    ap.add_argument("--max_prompt_tokens", type=int, default=400)
    ap.add_argument("--cue_words", type=int, default=3)
    ap.add_argument("--max_new_tokens", type=int, default=48)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--methods", default="none,draft,ngram")
    ap.add_argument("--num_draft_tokens", type=int, default=4)
    ap.add_argument("--prompt_lookup_min", type=int, default=None,
                    help="default: the router's (vLLM's 5)")
    ap.add_argument("--prompt_lookup_max", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--router_args", default="")
    ap.add_argument("--target_args", default="")
    ap.add_argument("--speculator_args", default="")
    a = ap.parse_args()
    methods = a.methods.split(",")
    rates = {}  # (method, clients) -> output tok/s of each run
    print("| method | clients | output tok/s | tokens / target forward | "
          "mean acceptance length | identical to none | failed | "
          "drafts / round | round ms | target round ms | draft ms / round | "
          "mean TTFT ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    with Stack(speculator_model=a.speculator_model,
               target_model=a.target_model, tokenizer=a.tokenizer,
               router_args=a.router_args.split(),
               target_args=a.target_args.split(),
               speculator_args=a.speculator_args.split()) as st:
        stub = pb_grpc.RouterStub(grpc.insecure_channel(st.router.address))
        if a.workload == "repeat":
            prompts = repeat_prompts(stub, a.num_prompts, a.story_tokens,
                                     a.seed)
        else:
            prompts = copy_prompts(a.num_prompts, a.max_prompt_tokens,
                                   a.cue_words, a.seed)
        # Every prompt once first (one output token, drafting on so the
        # speculator prefills it too): the services' prefix caches then hold
        # the prompts for every timed run alike, not only for the runs after
        # the first, which had favoured every method but the first listed.
        warm = argparse.Namespace(**vars(a))
        warm.max_new_tokens = 1
        run(stub, prompts, 1, "draft", warm)
        for c in [int(x) for x in a.concurrency.split(",")]:
            reference = None
            for method in methods:
                run(stub, prompts[:2], 1, method, a)  # warm-up
                before = round_times(st)
                res, wall, failures = run(stub, prompts, c, method, a)
                after = round_times(st)
                ok = [r for r in res if r is not None]
                tokens = sum(r.usage.completion_tokens for r in ok)
                forwards = sum(r.stats.num_target_forwards for r in ok)
                drafted = [r.stats.mean_acceptance_length for r in ok
                           if r.stats.num_drafts > 0]
                if method == "none":
                    reference = res
                same = "-"
                if reference is not None and method != "none":
                    same = "%d/%d" % (sum(
                        1 for r, ref in zip(res, reference)
                        if r is not None and ref is not None and
                        list(r.token_ids) == list(ref.token_ids)), len(res))
                draft_tokens = sum(r.stats.num_draft_tokens for r in ok)
                rounds = sum(r.stats.num_drafts for r in ok)
                ttft = [r.stats.ttft_s for r in ok]
                print("| %s | %d | %.1f | %.2f | %s | %s | %d | %s | %.3f | %s | %s | %s |" % (
                    method, c, tokens / wall, tokens / max(1, forwards),
                    "%.2f" % (sum(drafted) / len(drafted)) if drafted else "-",
                    same, len(failures),
                    "%.2f" % (draft_tokens / rounds) if rounds else "-",
                    1e3 * wall * c / max(1, forwards),
                    mean_ms(before, after, "target_round"),
                    mean_ms(before, after, "draft"),
                    "%.2f" % (1e3 * sum(ttft) / len(ttft)) if ttft else "-"))
                rates.setdefault((method, c), []).append(tokens / wall)
                sys.stdout.flush()
    # A method listed more than once (alternated runs, e.g. ABBA against
    # the box's drift): the mean and spread of its runs.
    repeated = {k: v for k, v in rates.items() if len(v) > 1}
    if repeated:
        print()
        print("| method | clients | runs | output tok/s mean | sd | min | max |")
        print("|---|---|---|---|---|---|---|")
        for (method, c), v in repeated.items():
            print("| %s | %d | %d | %.1f | %.1f | %.1f | %.1f |" % (
                method, c, len(v), statistics.mean(v), statistics.stdev(v),
                min(v), max(v)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

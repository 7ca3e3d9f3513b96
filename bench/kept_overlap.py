#!/usr/bin/env python3
"""Speculative Prefill's kept set with bf16 / int8 weights against f32's.

  bench/kept_overlap.py [--models models/stories260K-draft,...]
      [--chunk_sizes 32,1] [--keep_ratio 0.3]

For every golden prompt (tests/data/golden/prompts/*.txt) that the model's
context holds, runs bazel-bin/tools/score once per weight dtype and prints
the share of f32's kept token indices that the other dtype keeps too, and
how many prompts keep exactly the same set. Build first: bazel build -c opt
//tools:score.
"""

import argparse
import glob
import json
import os
import subprocess
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def kept(model, prompt, dtype, chunk, keep):
    out = subprocess.run(
        [os.path.join(REPO, "bazel-bin/tools/score"), "--model", model,
         "--prompt", prompt, "--keep_ratio", str(keep), "--chunk_size",
         str(chunk), "--weight_dtype", dtype],
        capture_output=True, text=True)
    if out.returncode != 0:
        return None  # e.g. longer than the model's context
    return set(json.loads(out.stdout.strip().splitlines()[-1])["kept_indices"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models",
                    default="models/stories260K-draft,models/tinystories-656K-draft")
    ap.add_argument("--chunk_sizes", default="32,1")
    ap.add_argument("--keep_ratio", type=float, default=0.3)
    a = ap.parse_args()
    os.chdir(REPO)
    prompts = [open(p).read() for p in
               sorted(glob.glob("tests/data/golden/prompts/*.txt"))]
    print("| speculator | chunk size | weights | prompts | f32 kept tokens "
          "also kept | identical kept sets |")
    print("|---|---|---|---|---|---|")
    for model in a.models.split(","):
        for chunk in a.chunk_sizes.split(","):
            ref = [kept(model, p, "f32", chunk, a.keep_ratio) for p in prompts]
            for dtype in ("bf16", "int8"):
                both = total = same = n = 0
                for p, r in zip(prompts, ref):
                    if r is None:
                        continue
                    k = kept(model, p, dtype, chunk, a.keep_ratio)
                    n += 1
                    both += len(r & k)
                    total += len(r)
                    same += r == k
                print("| %s | %s | %s | %d | %d/%d = %.3f | %d/%d |" % (
                    os.path.basename(model), chunk, dtype, n, both, total,
                    both / max(total, 1), same, n))
    return 0


if __name__ == "__main__":
    sys.exit(main())

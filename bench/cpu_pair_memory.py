#!/usr/bin/env python3
"""Serves one request with a large target and speculator pair on the CPU
engine and reports each service's start-up time and resident memory.

  bench/cpu_pair_memory.py --target DIR --speculator DIR --tokenizer DIR \
      [--weight_dtype bf16] [--prompt TEXT] [--max_new_tokens N]

The checkpoints are typically synthetic (bazel-bin/tools/make_synthetic_checkpoint
--preset llama-3.2-3b --dtype BF16 --out DIR), so the text is noise; what is
measured is whether the pair fits and serves, and what each process holds.
Build first: bazel build -c opt //router //speculator_service
//target_service //tools:client.
"""

import argparse
import os
import subprocess
import sys
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(REPO, "tests"))
from stack import Stack, find_binary  # noqa: E402


def status_kb(pid, field):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def mem_available_kb():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1])
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--speculator", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--weight_dtype", default="bf16")
    ap.add_argument("--prompt", default="Once upon a time, in a quiet village "
                    "by the sea, there lived a girl who collected shells. " * 8)
    ap.add_argument("--max_new_tokens", type=int, default=16)
    a = ap.parse_args()
    os.chdir(REPO)
    model_args = ["--weight_dtype", a.weight_dtype]
    avail0 = mem_available_kb()
    t0 = time.time()
    with Stack(speculator_model=a.speculator, target_model=a.target,
               tokenizer=a.tokenizer, speculator_args=model_args,
               target_args=model_args) as stack:
        ready = time.time() - t0
        cmd = [find_binary("tools/client"), "--router", stack.router.address,
               "--prompt", a.prompt, "--max_new_tokens", str(a.max_new_tokens)]
        t1 = time.time()
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        took = time.time() - t1
        print(out.stdout[-2000:])
        if out.returncode != 0:
            print(out.stderr[-2000:])
            return 1
        print("| service | checkpoint | VmRSS GB | VmHWM (peak) GB |")
        print("|---|---|---|---|")
        total_rss = total_hwm = 0
        for name, svc, ckpt in (("speculator", stack.speculator, a.speculator),
                                ("target", stack.target, a.target),
                                ("router", stack.router, a.tokenizer)):
            rss = status_kb(svc.proc.pid, "VmRSS") / 1e6
            hwm = status_kb(svc.proc.pid, "VmHWM") / 1e6
            total_rss += rss
            total_hwm += hwm
            print("| %s | %s | %.2f | %.2f |" % (name, os.path.basename(
                ckpt.rstrip("/")), rss, hwm))
        print("| all three | | %.2f | %.2f (sum of peaks) |" % (total_rss,
                                                                total_hwm))
        print("weights %s; all three ready in %.1f s (sequential starts); "
              "request %.1f s; MemAvailable before %.1f GB, during %.1f GB" % (
                  a.weight_dtype, ready, took, avail0 / 1e6,
                  mem_available_kb() / 1e6))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Runs the specserve stack (speculator, target, router) on loopback with
the bundled pair (stories260K-draft -> stories260K).

  --demo (default): sends one prompt through the router with //tools:client,
      prints the text and stats, and shuts everything down.
  --serve: keeps the stack running (router on --router_port) until Ctrl-C.

Binaries come from bazel-bin: build them first (tools/quickstart.sh does).
"""

import argparse
import os
import signal
import subprocess
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(REPO, "tests"))
from stack import Stack, find_binary  # noqa: E402

# A 267-token story: long enough for chunked selection (32-token chunks,
# keep 0.3) to have something to choose from.
DEMO_PROMPT_FILE = "tests/data/golden/prompts/written_tom_kite.txt"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--demo", action="store_true", default=True)
    mode.add_argument("--serve", action="store_true")
    ap.add_argument("--router_port", type=int, default=50050)
    ap.add_argument("--prompt", default=None,
                    help="prompt text (default: the story in %s)" % DEMO_PROMPT_FILE)
    ap.add_argument("client_args", nargs="*",
                    help="extra //tools:client flags, after --")
    a = ap.parse_args()
    os.chdir(REPO)
    port = a.router_port if a.serve else 0
    # --serve uses the default metrics ports that
    # deploy/prometheus/prometheus-local.yml scrapes.
    metrics = (9161, 9092, 9151) if a.serve else (0, 0, 0)
    prompt = a.prompt or open(os.path.join(REPO, DEMO_PROMPT_FILE)).read().strip()
    with Stack(router_port=port, metrics_ports=metrics) as stack:
        if a.serve:
            print("speculator %s (metrics :%d), target %s (metrics :%d), "
                  "router %s (metrics :%d). Ctrl-C stops." % (
                      stack.speculator.address, stack.speculator.metrics_port,
                      stack.target.address, stack.target.metrics_port,
                      stack.router.address, stack.router.metrics_port))
            print("try: bazel-bin/tools/client --router %s --prompt 'Once upon a time'"
                  % stack.router.address)
            try:
                signal.pause()
            except KeyboardInterrupt:
                pass
            return 0
        cmd = [find_binary("tools/client"), "--router", stack.router.address,
               "--prompt", prompt, "--max_new_tokens", "96",
               "--stop_token_ids", "1"] + a.client_args
        return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())

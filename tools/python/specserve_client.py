#!/usr/bin/env python3
"""Python client example for the specserve router (specserve.v1.Router).

Uses Debian's python3-grpcio; the message and stub modules are generated
from ../../protos at first use with Debian's protoc and grpc_python_plugin
into a cache directory, so nothing generated is checked in.

    /usr/bin/python3 tools/python/specserve_client.py --router localhost:50050 \
        --prompt "Once upon a time" --max_new_tokens 48 [--stream]
"""

import argparse
import importlib
import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PROTOS = ["protos/common.proto", "protos/router.proto"]


def load_stubs(out_dir=None):
    """Generates (if needed) and imports the router's Python modules.

    Returns (router_pb2, router_pb2_grpc). Raises RuntimeError if protoc
    fails.
    """
    out_dir = out_dir or os.path.join(tempfile.gettempdir(), "specserve_py_stubs")
    marker = os.path.join(out_dir, "protos", "router_pb2_grpc.py")
    newest = max(os.path.getmtime(os.path.join(REPO, p)) for p in PROTOS)
    if not os.path.exists(marker) or os.path.getmtime(marker) < newest:
        # Debian's protoc (3.21) and grpc_python_plugin, the same packages
        # the C++ build uses (protobuf-compiler, protobuf-compiler-grpc).
        os.makedirs(out_dir, exist_ok=True)
        cmd = ["protoc", "-I" + REPO, "--python_out=" + out_dir,
               "--grpc_out=" + out_dir,
               "--plugin=protoc-gen-grpc=" + shutil.which("grpc_python_plugin")]
        cmd += [os.path.join(REPO, p) for p in PROTOS]
        if subprocess.call(cmd) != 0:
            raise RuntimeError("protoc failed for %s" % PROTOS)
        open(os.path.join(out_dir, "protos", "__init__.py"), "a").close()
    if out_dir not in sys.path:
        sys.path.insert(0, out_dir)
    return (importlib.import_module("protos.router_pb2"),
            importlib.import_module("protos.router_pb2_grpc"))


def build_request(pb, prompt=None, token_ids=None, max_new_tokens=None,
                  temperature=None, seed=None, keep_ratio=None,
                  num_draft_tokens=None, spec_prefill=None, spec_decode=None,
                  stop=None):
    """Builds a GenerateTextRequest; None leaves a field to the router."""
    req = pb.GenerateTextRequest()
    if token_ids is not None:
        req.token_ids.ids.extend(token_ids)
    else:
        req.text = prompt or ""
    if max_new_tokens is not None:
        req.sampling.max_new_tokens = max_new_tokens
    if temperature is not None:
        req.sampling.temperature = temperature
    if seed is not None:
        req.sampling.seed = seed
    if stop:
        req.sampling.stop.extend(stop)
    if keep_ratio is not None:
        req.speculative_prefill.keep_ratio = keep_ratio
    if spec_prefill is not None:
        req.speculative_prefill.enabled = spec_prefill
    if num_draft_tokens is not None:
        req.speculative_decoding.num_draft_tokens = num_draft_tokens
    if spec_decode is not None:
        req.speculative_decoding.enabled = spec_decode
    return req


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--router", default="localhost:50050")
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("--max_new_tokens", type=int)
    ap.add_argument("--temperature", type=float)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--keep_ratio", type=float)
    ap.add_argument("--num_draft_tokens", type=int)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--timeout", type=float, default=60.0)
    a = ap.parse_args()

    import grpc
    pb, pb_grpc = load_stubs()
    stub = pb_grpc.RouterStub(grpc.insecure_channel(a.router))
    req = build_request(pb, prompt=a.prompt, max_new_tokens=a.max_new_tokens,
                        temperature=a.temperature, seed=a.seed,
                        keep_ratio=a.keep_ratio,
                        num_draft_tokens=a.num_draft_tokens)
    try:
        if a.stream:
            last = None
            for chunk in stub.GenerateStream(req, timeout=a.timeout):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                last = chunk
            usage, stats, finish = last.usage, last.stats, last.finish_reason
        else:
            resp = stub.Generate(req, timeout=a.timeout)
            sys.stdout.write(resp.text)
            usage, stats, finish = resp.usage, resp.stats, resp.finish_reason
    except grpc.RpcError as e:
        print("error: %s %s" % (e.code().name, e.details()), file=sys.stderr)
        return 2 if e.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    print()
    print("[finish %s] prompt %d, kept %d, completion %d; TTFT %.4f s; "
          "mean acceptance length %.2f%s" % (
              finish, usage.prompt_tokens, usage.kept_prompt_tokens,
              usage.completion_tokens, stats.ttft_s,
              stats.mean_acceptance_length,
              ("; fallback: " + stats.fallback_reason) if stats.fallback_reason else ""),
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

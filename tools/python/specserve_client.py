#!/usr/bin/env python3
"""Python client example for the specserve router (specserve.v1.Router).

Uses Debian's python3-grpcio; the message and stub modules are generated
from ../../protos at first use with Debian's protoc and grpc_python_plugin
into a cache directory, so nothing generated is checked in.

    /usr/bin/python3 tools/python/specserve_client.py --router localhost:50050 \
        --prompt "Once upon a time" --max_new_tokens 48 [--stream]

Plaintext by default. Against a router serving TLS (its --tls_cert_file),
pass --tls_ca_file (or --tls for the default roots); for mutual TLS also
--tls_cert_file and --tls_key_file; --tls_server_name checks the router's
certificate for another name than the dialled host. The same flags as
//tools:client; make_channel() does the same for library use.
"""

import argparse
import importlib
import json
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


def _read_pem(flag, path):
    with open(path, "rb") as f:
        data = f.read()
    if b"-----BEGIN " not in data:
        raise ValueError("%s %s: not a PEM file" % (flag, path))
    return data


def make_channel(address, tls=False, ca_file=None, cert_file=None,
                 key_file=None, server_name=None):
    """Opens a gRPC channel to the router at `address` ("host:port").

    Plaintext unless `tls` or any file is given; then TLS verified by the
    PEM CA bundle `ca_file` (gRPC's default roots without one), presenting
    `cert_file` and `key_file` (both or neither) for mutual TLS, and
    checking the certificate for `server_name` instead of the host when
    set. Raises ValueError for an incomplete set or a file that is not PEM
    and OSError (FileNotFoundError, ...) for a file that cannot be read.
    """
    import grpc
    if not (tls or ca_file or cert_file or key_file):
        if server_name:
            raise ValueError("--tls_server_name is set but TLS is off (set "
                             "--tls or --tls_ca_file)")
        return grpc.insecure_channel(address)
    if bool(cert_file) != bool(key_file):
        raise ValueError("mutual TLS needs both --tls_cert_file and "
                         "--tls_key_file; only %s is set" % (
                             "--tls_cert_file" if cert_file else
                             "--tls_key_file"))
    ca = _read_pem("--tls_ca_file", ca_file) if ca_file else None
    key = _read_pem("--tls_key_file", key_file) if key_file else None
    chain = _read_pem("--tls_cert_file", cert_file) if cert_file else None
    creds = grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=chain)
    options = ([("grpc.ssl_target_name_override", server_name)]
               if server_name else [])
    return grpc.secure_channel(address, creds, options=options)


def build_request(pb, prompt=None, token_ids=None, max_new_tokens=None,
                  temperature=None, seed=None, keep_ratio=None,
                  num_draft_tokens=None, spec_prefill=None, spec_decode=None,
                  stop=None, spec_decode_method=None, prompt_lookup_min=None,
                  prompt_lookup_max=None, tree_branching=None,
                  tree_max_nodes=None, tree_min_path_prob=None,
                  logprobs=None, presence_penalty=None,
                  frequency_penalty=None, repetition_penalty=None,
                  logit_bias=None, min_tokens=None, min_p=None,
                  json_object=None, prompt_logprobs=None, json_schema=None):
    """Builds a GenerateTextRequest; None leaves a field to the router.

    spec_decode_method: "draft" | "ngram" | "draft_tree"; tree_branching a
    list of ints (children per node at each depth); tree_min_path_prob in
    [0, 1), the path probability a tree node needs to grow with one request
    in flight. logprobs: N in [0, 20] returns each token's logprob (the
    target's raw logits) with the N likeliest alternatives
    (response.logprobs, aligned with token_ids); None = off.
    presence_penalty / frequency_penalty in [-2, 2] (generated ids) and
    repetition_penalty > 0 (prompt and generated ids) as OpenAI and vLLM
    define them. logit_bias: {token id: bias in [-100, 100]}; min_tokens:
    no EOS, stop id or stop string before this many tokens (vLLM's);
    min_p in [0, 1]; json_object: JSON mode (the output is one JSON
    object, OpenAI's response_format json_object). prompt_logprobs: N in
    [0, 20] returns each prompt token's logprob after the first (vLLM's;
    response.prompt_logprobs, aligned with response.prompt_token_ids[1:]);
    the whole prompt is then prefilled (no Speculative Prefill).
    json_schema: a JSON Schema (a dict, or its JSON text) the output is an
    instance of; properties are written in the schema's order."""
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
    if presence_penalty is not None:
        req.sampling.presence_penalty = presence_penalty
    if frequency_penalty is not None:
        req.sampling.frequency_penalty = frequency_penalty
    if repetition_penalty is not None:
        req.sampling.repetition_penalty = repetition_penalty
    for token_id, bias in (logit_bias or {}).items():
        req.sampling.logit_bias[int(token_id)] = bias
    if min_tokens is not None:
        req.sampling.min_tokens = min_tokens
    if min_p is not None:
        req.sampling.min_p = min_p
    if json_object:
        req.sampling.json_object = True
    if json_schema is not None:
        req.sampling.json_schema = (json_schema if isinstance(json_schema, str)
                                    else json.dumps(json_schema))
    if stop:
        req.sampling.stop.extend(stop)
    if logprobs is not None:
        req.sampling.logprobs = True
        req.sampling.top_logprobs = logprobs
    if prompt_logprobs is not None:
        req.sampling.prompt_logprobs = prompt_logprobs
    if keep_ratio is not None:
        req.speculative_prefill.keep_ratio = keep_ratio
    if spec_prefill is not None:
        req.speculative_prefill.enabled = spec_prefill
    if num_draft_tokens is not None:
        req.speculative_decoding.num_draft_tokens = num_draft_tokens
    if spec_decode is not None:
        req.speculative_decoding.enabled = spec_decode
    sd = req.speculative_decoding
    if spec_decode_method is not None:
        sd.method = spec_decode_method
    if prompt_lookup_min is not None:
        sd.prompt_lookup_min = prompt_lookup_min
    if prompt_lookup_max is not None:
        sd.prompt_lookup_max = prompt_lookup_max
    if tree_branching:
        sd.tree_branching.extend(tree_branching)
    if tree_max_nodes is not None:
        sd.tree_max_nodes = tree_max_nodes
    if tree_min_path_prob is not None:
        sd.tree_min_path_prob = tree_min_path_prob
    return req


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--router", default="localhost:50050")
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("--max_new_tokens", type=int)
    ap.add_argument("--temperature", type=float)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--presence_penalty", type=float,
                    help="[-2, 2], on generated ids (0 = off)")
    ap.add_argument("--frequency_penalty", type=float,
                    help="[-2, 2], per generated occurrence (0 = off)")
    ap.add_argument("--repetition_penalty", type=float,
                    help="> 0, on prompt and generated ids (1 = off)")
    ap.add_argument("--logit_bias",
                    help="id:bias,... added to those ids' logits")
    ap.add_argument("--min_p", type=float,
                    help="[0, 1]: drop tokens less likely than min_p times "
                         "the likeliest")
    ap.add_argument("--json_schema",
                    help="structured output: a JSON Schema (its JSON text) "
                         "the output is an instance of")
    ap.add_argument("--json_object", action="store_true",
                    help="JSON mode: the output is one JSON object")
    ap.add_argument("--min_tokens", type=int,
                    help="no EOS, stop id or stop string before this many "
                         "tokens")
    ap.add_argument("--keep_ratio", type=float)
    ap.add_argument("--num_draft_tokens", type=int)
    ap.add_argument("--spec_decode_method", choices=["draft", "ngram", "draft_tree"],
                    help="how drafts are proposed (default: the router's)")
    ap.add_argument("--prompt_lookup_min", type=int,
                    help="ngram: shortest n-gram looked up")
    ap.add_argument("--prompt_lookup_max", type=int,
                    help="ngram: longest n-gram looked up")
    ap.add_argument("--tree_branching",
                    help="draft_tree: children per node at each depth, e.g. 3,2,2,2,2,2")
    ap.add_argument("--tree_max_nodes", type=int,
                    help="draft_tree: node budget")
    ap.add_argument("--tree_min_path_prob", type=float,
                    help="draft_tree: path probability a node needs to grow "
                         "(one request in flight)")
    ap.add_argument("--logprobs", type=int,
                    help="print each token's logprob with the N likeliest "
                         "alternatives (N in [0, 20])")
    ap.add_argument("--prompt_logprobs", type=int,
                    help="print each prompt token's logprob (after the "
                         "first) with the N likeliest alternatives; the "
                         "whole prompt is prefilled")
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--tls", action="store_true",
                    help="TLS to the router (implied by any --tls_* file); "
                         "without --tls_ca_file gRPC's default roots verify it")
    ap.add_argument("--tls_ca_file",
                    help="PEM CA bundle that verifies the router's certificate")
    ap.add_argument("--tls_cert_file",
                    help="PEM certificate chain this client presents "
                         "(mutual TLS)")
    ap.add_argument("--tls_key_file", help="PEM private key of --tls_cert_file")
    ap.add_argument("--tls_server_name",
                    help="name the router's certificate must carry instead "
                         "of the dialled host")
    a = ap.parse_args()

    import grpc
    try:
        channel = make_channel(a.router, tls=a.tls, ca_file=a.tls_ca_file,
                               cert_file=a.tls_cert_file,
                               key_file=a.tls_key_file,
                               server_name=a.tls_server_name)
    except (ValueError, OSError) as e:
        print("error: %s" % e, file=sys.stderr)
        return 2
    pb, pb_grpc = load_stubs()
    stub = pb_grpc.RouterStub(channel)
    req = build_request(pb, prompt=a.prompt, max_new_tokens=a.max_new_tokens,
                        temperature=a.temperature, seed=a.seed,
                        presence_penalty=a.presence_penalty,
                        frequency_penalty=a.frequency_penalty,
                        repetition_penalty=a.repetition_penalty,
                        logit_bias=({int(k): float(v) for k, v in
                                     (e.split(":") for e in
                                      a.logit_bias.split(","))}
                                    if a.logit_bias else None),
                        min_tokens=a.min_tokens, min_p=a.min_p,
                        json_object=a.json_object or None,
                        json_schema=a.json_schema,
                        keep_ratio=a.keep_ratio,
                        num_draft_tokens=a.num_draft_tokens,
                        spec_decode_method=a.spec_decode_method,
                        prompt_lookup_min=a.prompt_lookup_min,
                        prompt_lookup_max=a.prompt_lookup_max,
                        tree_branching=[int(x) for x in a.tree_branching.split(",")]
                        if a.tree_branching else None,
                        tree_max_nodes=a.tree_max_nodes,
                        tree_min_path_prob=a.tree_min_path_prob,
                        logprobs=a.logprobs,
                        prompt_logprobs=a.prompt_logprobs)
    try:
        if a.stream:
            last = None
            ids, lps, prompt_ids, prompt_lps = [], [], [], []
            for chunk in stub.GenerateStream(req, timeout=a.timeout):
                prompt_ids.extend(chunk.prompt_token_ids)
                prompt_lps.extend(chunk.prompt_logprobs)
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                ids.extend(chunk.token_ids)
                lps.extend(chunk.logprobs)
                last = chunk
            usage, stats, finish = last.usage, last.stats, last.finish_reason
        else:
            resp = stub.Generate(req, timeout=a.timeout)
            sys.stdout.write(resp.text)
            usage, stats, finish = resp.usage, resp.stats, resp.finish_reason
            ids, lps = list(resp.token_ids), list(resp.logprobs)
            prompt_ids = list(resp.prompt_token_ids)
            prompt_lps = list(resp.prompt_logprobs)
    except grpc.RpcError as e:
        print("error: %s %s" % (e.code().name, e.details()), file=sys.stderr)
        return 2 if e.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    print()
    for token_id, lp in zip(prompt_ids[1:], prompt_lps):
        print("prompt token %d logprob %.4f top %s" % (
            token_id, lp.logprob,
            " ".join("%d:%.4f" % (t.id, t.logprob) for t in lp.top)),
            file=sys.stderr)
    for token_id, lp in zip(ids, lps):
        print("token %d logprob %.4f top %s" % (
            token_id, lp.logprob,
            " ".join("%d:%.4f" % (t.id, t.logprob) for t in lp.top)),
            file=sys.stderr)
    print("[finish %s] prompt %d, kept %d, completion %d; TTFT %.4f s; "
          "drafting %s: mean acceptance length %.2f, %d target forwards, "
          "%.2f tokens per forward%s" % (
              finish, usage.prompt_tokens, usage.kept_prompt_tokens,
              usage.completion_tokens, stats.ttft_s,
              stats.spec_decode_method or "none",
              stats.mean_acceptance_length, stats.num_target_forwards,
              stats.tokens_per_target_forward,
              ("; fallback: " + stats.fallback_reason) if stats.fallback_reason else ""),
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

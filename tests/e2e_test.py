"""End-to-end tests of the real binaries over loopback:
speculator + target + router processes, driven through the Python client.
"""

import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                "tools", "python"))
import grpc  # noqa: E402
import specserve_client  # noqa: E402
from stack import Stack, find_binary, wait_until  # noqa: E402

pb, pb_grpc = specserve_client.load_stubs(
    os.path.join(os.environ.get("TEST_TMPDIR", tempfile.gettempdir()), "stubs"))

PROMPT = ("Sue loved her garden. She had red flowers, white flowers and a little "
          "green plant that did not have any flowers yet. Every morning she gave "
          "the plants water. One day, a big brown rabbit came into the garden.")


def run_json(argv):
    out = subprocess.run(argv, check=True, capture_output=True, text=True,
                         timeout=120)
    return json.loads(out.stdout)


def tokenize(text):
    return run_json([find_binary("tools/tokenize"), "--model",
                     "models/stories260K", "--text", text])["ids"]


def reference(ids, positions=None, next_position=None, max_new=32):
    """The target alone (//tools:generate), greedy."""
    argv = [find_binary("tools/generate"), "--model", "models/stories260K",
            "--token_ids", ",".join(map(str, ids)),
            "--max_new_tokens", str(max_new), "--json"]
    if positions is not None:
        argv += ["--position_ids", ",".join(map(str, positions)),
                 "--next_position", str(next_position)]
    return run_json(argv)


class E2ETest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.stack = Stack()
        cls.channel = grpc.insecure_channel(cls.stack.router.address)
        cls.stub = pb_grpc.RouterStub(cls.channel)
        cls.ids = tokenize(PROMPT)

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        cls.stack.close()

    def request(self, **kw):
        kw.setdefault("token_ids", self.ids)
        kw.setdefault("max_new_tokens", 32)
        kw.setdefault("temperature", 0.0)
        return specserve_client.build_request(pb, **kw)

    def test_a_keep_all_with_spec_decoding_equals_target_alone(self):
        resp = self.stub.Generate(self.request(keep_ratio=1.0, num_draft_tokens=4),
                                  timeout=60)
        ref = reference(self.ids)
        self.assertEqual(list(resp.token_ids), ref["token_ids"])
        self.assertEqual(resp.usage.kept_prompt_tokens, len(self.ids))
        self.assertGreater(resp.stats.num_draft_tokens, 0)
        self.assertGreater(resp.stats.num_accepted_tokens, 0)
        self.assertGreaterEqual(resp.stats.mean_acceptance_length, 1.0)

    def test_b_pruned_prompt_equals_generate_on_kept_tokens(self):
        req = self.request(keep_ratio=0.3, spec_decode=False)
        req.speculative_prefill.chunk_size = 8
        req.speculative_prefill.look_ahead = 8
        req.speculative_prefill.pool_kernel_size = 13
        req.speculative_prefill.keep_first = 1
        req.speculative_prefill.keep_last = 1
        resp = self.stub.Generate(req, timeout=60)
        score = run_json([find_binary("tools/score"), "--model",
                          "models/stories260K-draft", "--token_ids",
                          ",".join(map(str, self.ids)), "--keep_ratio", "0.3",
                          "--chunk_size", "8", "--pool_kernel_size", "13",
                          "--look_ahead", "8", "--keep_first", "1",
                          "--keep_last", "1"])
        kept = score["kept_indices"]
        self.assertLess(len(kept), len(self.ids))
        self.assertEqual(resp.usage.prompt_tokens, len(self.ids))
        self.assertEqual(resp.usage.kept_prompt_tokens, len(kept))
        ref = reference([self.ids[i] for i in kept], kept, len(self.ids))
        self.assertEqual(list(resp.token_ids), ref["token_ids"])
        self.assertEqual(resp.text, ref["text"])

    def test_e_bad_input_gets_the_right_codes(self):
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        cases = {
            "empty prompt": self.request(token_ids=[]),
            "id outside vocab": self.request(token_ids=[1, 5, 512]),
            "keep_ratio 0": self.request(keep_ratio=0.0),
            "keep_ratio > 1": self.request(keep_ratio=1.5),
            "negative temperature": self.request(temperature=-1.0),
            "num_draft_tokens 0": self.request(num_draft_tokens=0),
            "num_draft_tokens 65": self.request(num_draft_tokens=65),
            "max_new_tokens 0": self.request(max_new_tokens=0),
            "prompt past context": self.request(token_ids=[1] + [300] * 600),
        }
        r = self.request()
        r.speculative_prefill.chunk_size = 0
        cases["chunk_size 0"] = r
        r = self.request()
        r.speculative_prefill.pool_kernel_size = 4
        cases["even pool kernel"] = r
        r = self.request()
        r.speculative_prefill.look_ahead = 65
        cases["look_ahead 65"] = r
        r = self.request()
        r.sampling.top_p = 1.5
        cases["top_p 1.5"] = r
        for name, req in cases.items():
            with self.subTest(name):
                with self.assertRaises(grpc.RpcError) as ctx:
                    self.stub.Generate(req, timeout=30)
                self.assertEqual(ctx.exception.code(), invalid,
                                 ctx.exception.details())

    def test_f_concurrent_clients_with_mixed_settings(self):
        greedy_ref = reference(self.ids, max_new=24)["token_ids"]

        def one(i):
            kw = dict(max_new_tokens=24)
            if i % 4 == 0:
                kw.update(keep_ratio=1.0, num_draft_tokens=2 + i % 5)
            elif i % 4 == 1:
                kw.update(spec_prefill=False, spec_decode=False)
            elif i % 4 == 2:
                kw.update(spec_prefill=False, num_draft_tokens=4)
            else:
                kw.update(keep_ratio=0.5, temperature=0.8, seed=i)
            resp = self.stub.Generate(self.request(**kw), timeout=120)
            return i, kw, resp

        with concurrent.futures.ThreadPoolExecutor(32) as ex:
            results = list(ex.map(one, range(32)))
        for i, kw, resp in results:
            self.assertGreater(resp.usage.completion_tokens, 0)
            if i % 4 != 3:  # greedy over the full prompt: must equal the target
                self.assertEqual(list(resp.token_ids), greedy_ref, kw)

    def test_g_streaming_equals_unary(self):
        req = self.request(keep_ratio=0.5, num_draft_tokens=3)
        unary = self.stub.Generate(req, timeout=60)
        chunks = list(self.stub.GenerateStream(req, timeout=60))
        self.assertGreater(len(chunks), 1)
        self.assertEqual("".join(c.text for c in chunks), unary.text)
        ids = [t for c in chunks for t in c.token_ids]
        self.assertEqual(ids, list(unary.token_ids))
        self.assertEqual(chunks[-1].finish_reason, unary.finish_reason)
        self.assertEqual(chunks[-1].usage.completion_tokens,
                         unary.usage.completion_tokens)

    def test_j_logprobs_through_both_clients(self):
        # build_request(logprobs=N): one logprob per token id, the greedy
        # token first among its N alternatives, the same with speculative
        # decoding on and off; //tools:client --logprobs prints them.
        plain = self.stub.Generate(self.request(logprobs=3, spec_decode=False,
                                                spec_prefill=False), timeout=60)
        spec = self.stub.Generate(self.request(logprobs=3, num_draft_tokens=4,
                                               spec_prefill=False), timeout=60)
        self.assertEqual(list(spec.token_ids), list(plain.token_ids))
        self.assertEqual(len(plain.logprobs), len(plain.token_ids))
        for token_id, a, b in zip(plain.token_ids, plain.logprobs,
                                  spec.logprobs):
            self.assertEqual(len(a.top), 3)
            self.assertEqual(a.top[0].id, token_id)
            self.assertAlmostEqual(a.logprob, b.logprob, delta=1e-4)
            self.assertLessEqual(a.logprob, 0.0)
        out = run_json([find_binary("tools/client"), "--router",
                        self.stack.router.address, "--token_ids",
                        ",".join(map(str, self.ids)), "--max_new_tokens", "32",
                        "--temperature", "0", "--no_spec_prefill",
                        "--logprobs", "3", "--json"])
        self.assertEqual(out["token_ids"], list(plain.token_ids))
        self.assertEqual(len(out["logprobs"]), len(out["token_ids"]))
        self.assertAlmostEqual(out["logprobs"][0]["logprob"],
                               plain.logprobs[0].logprob, delta=1e-5)
        bad = self.request(logprobs=21)
        with self.assertRaises(grpc.RpcError) as e:
            self.stub.Generate(bad, timeout=60)
        self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        # prompt_logprobs=N: the whole prompt reaches the target (the
        # router's default would prune it), one logprob per prompt token
        # after the first, and the output is the full prefill's.
        pl = self.stub.Generate(self.request(prompt_logprobs=2), timeout=60)
        self.assertEqual(list(pl.token_ids), list(plain.token_ids))
        self.assertEqual(list(pl.prompt_token_ids), list(self.ids))
        self.assertEqual(len(pl.prompt_logprobs), len(self.ids) - 1)
        self.assertEqual(pl.usage.kept_prompt_tokens, len(self.ids))
        for lp in pl.prompt_logprobs:
            self.assertEqual(len(lp.top), 2)
            self.assertLessEqual(lp.logprob, lp.top[0].logprob + 1e-5)
        out = run_json([find_binary("tools/client"), "--router",
                        self.stack.router.address, "--token_ids",
                        ",".join(map(str, self.ids)), "--max_new_tokens", "4",
                        "--temperature", "0", "--prompt_logprobs", "2",
                        "--json"])
        self.assertEqual(len(out["prompt_logprobs"]), len(self.ids) - 1)
        self.assertAlmostEqual(out["prompt_logprobs"][5]["logprob"],
                               pl.prompt_logprobs[5].logprob, delta=1e-5)

    def test_k_json_schema_through_both_clients(self):
        # build_request(json_schema=...) and --json_schema @file: the answer
        # is an instance of the schema, properties in its order, the same
        # from both clients; a schema with an unsupported keyword is
        # INVALID_ARGUMENT.
        schema = {"type": "object",
                  "properties": {"pet": {"enum": ["cat", "dog"]},
                                 "name": {"type": "string", "maxLength": 5},
                                 "ok": {"type": "boolean"}},
                  "required": ["pet", "name", "ok"]}
        resp = self.stub.Generate(self.request(json_schema=schema,
                                               max_new_tokens=120), timeout=60)
        self.assertEqual(resp.finish_reason, "eos", resp.text)
        value = json.loads(resp.text)
        self.assertEqual(list(value), ["pet", "name", "ok"])
        self.assertIn(value["pet"], ("cat", "dog"))
        self.assertIsInstance(value["ok"], bool)
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            json.dump(schema, f)
            f.flush()
            out = run_json([find_binary("tools/client"), "--router",
                            self.stack.router.address, "--token_ids",
                            ",".join(map(str, self.ids)), "--max_new_tokens",
                            "120", "--temperature", "0", "--json_schema",
                            "@" + f.name, "--json"])
        self.assertEqual(out["text"], resp.text)
        bad = dict(schema)
        bad["properties"] = {"pet": {"type": "string", "pattern": "^c"}}
        bad["required"] = ["pet"]
        with self.assertRaises(grpc.RpcError) as e:
            self.stub.Generate(self.request(json_schema=bad), timeout=60)
        self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("pattern", e.exception.details())

    def test_i_cli_reads_prompts_from_files(self):
        # //tools:client: --prompt_file and --token_ids_file (ids split by
        # commas and whitespace) give what --prompt / --token_ids give.
        client = find_binary("tools/client")
        base = [client, "--router", self.stack.router.address,
                "--max_new_tokens", "8", "--temperature", "0", "--json",
                "--no_spec_prefill"]
        tmp = os.environ.get("TEST_TMPDIR", tempfile.gettempdir())
        text_file = os.path.join(tmp, "prompt.txt")
        ids_file = os.path.join(tmp, "ids.txt")
        with open(text_file, "w") as f:
            f.write(PROMPT)
        with open(ids_file, "w") as f:
            f.write(",".join(map(str, self.ids[:10])) + "\n " +
                    " ".join(map(str, self.ids[10:])))
        by_arg = run_json(base + ["--prompt", PROMPT])
        by_file = run_json(base + ["--prompt_file", text_file])
        self.assertEqual(by_file["token_ids"], by_arg["token_ids"])
        ids_arg = run_json(base + ["--token_ids", ",".join(map(str, self.ids))])
        ids_by_file = run_json(base + ["--token_ids_file", ids_file])
        self.assertEqual(ids_by_file["token_ids"], ids_arg["token_ids"])
        self.assertEqual(ids_by_file["usage"]["prompt_tokens"], len(self.ids))
        both = subprocess.run(base + ["--prompt", "a", "--prompt_file",
                                      text_file], capture_output=True,
                              text=True, timeout=60)
        self.assertEqual(both.returncode, 2, both.stderr)
        missing = subprocess.run(base + ["--token_ids_file", "/no/such/file"],
                                 capture_output=True, text=True, timeout=60)
        self.assertEqual(missing.returncode, 2, missing.stderr)

    def test_h_client_cancel_frees_both_sessions(self):
        call = self.stub.GenerateStream(
            self.request(max_new_tokens=400, keep_ratio=1.0, num_draft_tokens=2,
                         stop=None), timeout=60)
        first = next(call)
        self.assertTrue(first.token_ids or first.text is not None)
        call.cancel()
        spec, target = self.stack.speculator, self.stack.target
        self.assertTrue(wait_until(
            lambda: (spec.metric_value("specserve_speculator_active_sessions") or 0) == 0
            and (target.metric_value("specserve_target_active_sessions") or 0) == 0,
            timeout=15), (spec.metrics(), target.metrics()))


class FaultTest(unittest.TestCase):
    """Each case gets its own stack: processes are killed."""

    def test_c_speculator_killed_mid_run_falls_back(self):
        with Stack(router_args=["--speculator_deadline_ms", "1000"]) as stack:
            stub = pb_grpc.RouterStub(grpc.insecure_channel(stack.router.address))
            ids = tokenize(PROMPT)
            req = specserve_client.build_request(
                pb, token_ids=ids, max_new_tokens=300, temperature=0.0,
                keep_ratio=1.0, num_draft_tokens=2)
            call = stub.GenerateStream(req, timeout=60)
            chunks = [next(call)]
            stack.speculator.kill()
            chunks += list(call)
            self.assertTrue(chunks[-1].finish_reason)
            ref = reference(ids, max_new=300)
            self.assertEqual([t for c in chunks for t in c.token_ids],
                             ref["token_ids"])
            # With the speculator gone the next request is served by the
            # target alone, and says so.
            resp = stub.Generate(req, timeout=60)
            self.assertEqual(list(resp.token_ids), ref["token_ids"])
            self.assertTrue(resp.stats.fallback_reason)

    def test_d_target_killed_gives_unavailable_within_deadline(self):
        with Stack() as stack:
            stub = pb_grpc.RouterStub(grpc.insecure_channel(stack.router.address))
            stack.target.kill()
            req = specserve_client.build_request(pb, prompt="Once upon a time",
                                                 max_new_tokens=16)
            t0 = time.time()
            with self.assertRaises(grpc.RpcError) as ctx:
                stub.Generate(req, timeout=20)
            self.assertEqual(ctx.exception.code(), grpc.StatusCode.UNAVAILABLE,
                             ctx.exception.details())
            self.assertLess(time.time() - t0, 20)


if __name__ == "__main__":
    unittest.main(verbosity=2)

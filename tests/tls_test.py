"""TLS and mutual TLS between the real binaries over loopback: certificates
made at test time by tests/make_test_certs.sh (the openssl CLI); the
speculator and target require client certificates from the router, and
the router's public port requires one from its clients, among them the
two command-line clients, //tools:client and
tools/python/specserve_client.py, with their --tls_* flags.
"""

import json
import os
import signal
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
from stack import Service, Stack, find_binary  # noqa: E402

TMP = os.environ.get("TEST_TMPDIR", tempfile.gettempdir())
pb, pb_grpc = specserve_client.load_stubs(os.path.join(TMP, "stubs"))
CERTS = os.path.join(TMP, "certs")


def cert(name):
    return os.path.join(CERTS, name)


def read(name):
    with open(cert(name), "rb") as f:
        return f.read()


def server_tls(mutual=True):
    args = ["--tls_cert_file", cert("server.pem"),
            "--tls_key_file", cert("server.key")]
    if mutual:
        args += ["--tls_client_ca_file", cert("ca.pem")]
    return args


ROUTER_BACKEND_MTLS = ["--backend_tls_ca_file", cert("ca.pem"),
                       "--backend_tls_cert_file", cert("client.pem"),
                       "--backend_tls_key_file", cert("client.key")]

PROMPT = ("Sue loved her garden. She had red flowers, white flowers and a little "
          "green plant that did not have any flowers yet. Every morning she gave "
          "the plants water. One day, a big brown rabbit came into the garden.")


CLIENT_MTLS = ["--tls_ca_file", cert("ca.pem"),
               "--tls_cert_file", cert("client.pem"),
               "--tls_key_file", cert("client.key")]


def run_cli(argv, timeout=90):
    """Runs a command-line client; its stubs and temp files go under TMP."""
    env = dict(os.environ, TMPDIR=TMP)
    return subprocess.run(argv, capture_output=True, text=True,
                          timeout=timeout, env=env)


def cpp_client(router, flags, stream=False):
    """//tools:client --json against `router` with `flags`."""
    return run_cli([find_binary("tools/client"), "--router", router,
                    "--prompt", PROMPT, "--max_new_tokens", "8",
                    "--temperature", "0", "--json", "--deadline_ms", "30000"] +
                   (["--stream"] if stream else []) + list(flags))


def python_client(router, flags):
    """tools/python/specserve_client.py against `router` with `flags`."""
    return run_cli(["/usr/bin/python3", "tools/python/specserve_client.py",
                    "--router", router, "--prompt", PROMPT,
                    "--max_new_tokens", "8", "--temperature", "0",
                    "--timeout", "30"] + list(flags))


def request(**kw):
    kw.setdefault("prompt", PROMPT)
    kw.setdefault("max_new_tokens", 16)
    kw.setdefault("temperature", 0.0)
    return specserve_client.build_request(pb, **kw)


class TlsStackTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        subprocess.run(["bash", "tests/make_test_certs.sh", CERTS], check=True)
        cls.stack = Stack(speculator_args=server_tls(), target_args=server_tls(),
                          router_args=server_tls() + ROUTER_BACKEND_MTLS)

    @classmethod
    def tearDownClass(cls):
        cls.stack.close()

    def call(self, credentials, req=None, timeout=60):
        with grpc.secure_channel(self.stack.router.address, credentials) as ch:
            return pb_grpc.RouterStub(ch).Generate(req or request(),
                                                   timeout=timeout)

    def assert_refused(self, credentials):
        with self.assertRaises(grpc.RpcError) as ctx:
            self.call(credentials, timeout=20)
        self.assertEqual(ctx.exception.code(), grpc.StatusCode.UNAVAILABLE,
                         ctx.exception.details())

    def test_request_through_mutual_tls_on_every_link(self):
        creds = grpc.ssl_channel_credentials(
            root_certificates=read("ca.pem"), private_key=read("client.key"),
            certificate_chain=read("client.pem"))
        resp = self.call(creds, request(keep_ratio=0.5, num_draft_tokens=4))
        self.assertGreater(resp.usage.completion_tokens, 0)
        # The speculator was reached over mTLS: the prompt was pruned and
        # drafts were proposed, with no fallback to the target alone.
        self.assertEqual(resp.stats.fallback_reason, "")
        self.assertLess(resp.usage.kept_prompt_tokens, resp.usage.prompt_tokens)
        self.assertGreater(resp.stats.num_draft_tokens, 0)
        # Streaming works over the same TLS channel.
        with grpc.secure_channel(self.stack.router.address, creds) as ch:
            chunks = list(pb_grpc.RouterStub(ch).GenerateStream(request(),
                                                                timeout=60))
        self.assertTrue(chunks[-1].finish_reason)

    def test_client_without_certificate_is_refused(self):
        self.assert_refused(grpc.ssl_channel_credentials(
            root_certificates=read("ca.pem")))

    def test_client_certificate_from_another_ca_is_refused(self):
        self.assert_refused(grpc.ssl_channel_credentials(
            root_certificates=read("ca.pem"),
            private_key=read("other_client.key"),
            certificate_chain=read("other_client.pem")))

    def test_wrong_ca_is_unavailable(self):
        self.assert_refused(grpc.ssl_channel_credentials(
            root_certificates=read("other_ca.pem"),
            private_key=read("client.key"),
            certificate_chain=read("client.pem")))

    def test_plaintext_client_is_refused(self):
        with grpc.insecure_channel(self.stack.router.address) as ch:
            with self.assertRaises(grpc.RpcError) as ctx:
                pb_grpc.RouterStub(ch).Generate(request(), timeout=20)
        self.assertEqual(ctx.exception.code(), grpc.StatusCode.UNAVAILABLE)

    def test_cpp_client_over_mutual_tls(self):
        for stream in (False, True):
            with self.subTest(stream=stream):
                out = cpp_client(self.stack.router.address, CLIENT_MTLS, stream)
                self.assertEqual(out.returncode, 0, out.stderr)
                j = json.loads(out.stdout)
                self.assertGreater(j["usage"]["completion_tokens"], 0, j)
                self.assertTrue(j["text"], j)
                self.assertEqual(j["stats"]["fallback_reason"], "", j)

    def test_cpp_client_server_name_override(self):
        # Certificates name "specserve-internal" (and 127.0.0.1, dialled).
        out = cpp_client(self.stack.router.address, CLIENT_MTLS + [
            "--tls_server_name", "specserve-internal"])
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertGreater(json.loads(out.stdout)["usage"]["completion_tokens"],
                           0)
        out = cpp_client(self.stack.router.address, CLIENT_MTLS + [
            "--tls_server_name", "someone-else"])
        self.assertEqual(out.returncode, 1, out.stderr)
        self.assertIn("error: 14 ", out.stderr)  # UNAVAILABLE

    def test_cpp_client_refused_without_certificate_or_in_plaintext(self):
        for flags in (["--tls_ca_file", cert("ca.pem")],  # no client cert
                      ["--tls_ca_file", cert("other_ca.pem"),
                       "--tls_cert_file", cert("client.pem"),
                       "--tls_key_file", cert("client.key")],  # wrong CA
                      []):  # plaintext
            with self.subTest(flags=flags):
                out = cpp_client(self.stack.router.address, flags)
                self.assertEqual(out.returncode, 1, out.stderr)
                self.assertIn("error: 14 ", out.stderr)  # UNAVAILABLE
                self.assertEqual(out.stdout, "")

    def test_python_client_over_mutual_tls(self):
        out = python_client(self.stack.router.address, CLIENT_MTLS)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertTrue(out.stdout.strip(), out.stderr)
        self.assertIn("[finish ", out.stderr)
        self.assertNotIn("fallback", out.stderr)
        # Without a client certificate the router refuses it.
        out = python_client(self.stack.router.address,
                            ["--tls_ca_file", cert("ca.pem")])
        self.assertEqual(out.returncode, 1, out.stderr)
        self.assertIn("error: UNAVAILABLE", out.stderr)

    def test_python_make_channel(self):
        # The library call behind the CLI flags, with the name override.
        with specserve_client.make_channel(
                self.stack.router.address, ca_file=cert("ca.pem"),
                cert_file=cert("client.pem"), key_file=cert("client.key"),
                server_name="specserve-internal") as ch:
            resp = pb_grpc.RouterStub(ch).Generate(request(), timeout=60)
        self.assertGreater(resp.usage.completion_tokens, 0)
        with specserve_client.make_channel(
                self.stack.router.address, ca_file=cert("ca.pem"),
                cert_file=cert("client.pem"), key_file=cert("client.key"),
                server_name="someone-else") as ch:
            with self.assertRaises(grpc.RpcError) as ctx:
                pb_grpc.RouterStub(ch).Generate(request(), timeout=20)
        self.assertEqual(ctx.exception.code(), grpc.StatusCode.UNAVAILABLE)

    def router(self, backend_args):
        """A second, plaintext router in front of the same TLS services."""
        return Service("router2", [
            find_binary("router/router"), "--port", "0", "--metrics_port", "0",
            "--speculator", self.stack.speculator.address,
            "--target", self.stack.target.address,
            "--tokenizer", "models/stories260K"] + backend_args)

    def test_services_refuse_a_router_without_client_certificate(self):
        r = self.router(["--backend_tls_ca_file", cert("ca.pem")])
        try:
            with grpc.insecure_channel(r.address) as ch:
                with self.assertRaises(grpc.RpcError) as ctx:
                    pb_grpc.RouterStub(ch).Generate(request(), timeout=20)
            self.assertEqual(ctx.exception.code(), grpc.StatusCode.UNAVAILABLE,
                             ctx.exception.details())
            self.assertIn("target", ctx.exception.details())
        finally:
            r.stop()

    def test_router_trusting_another_ca_reports_the_handshake_error(self):
        r = self.router(["--backend_tls_ca_file", cert("other_ca.pem"),
                         "--backend_tls_cert_file", cert("client.pem"),
                         "--backend_tls_key_file", cert("client.key")])
        try:
            with grpc.insecure_channel(r.address) as ch:
                with self.assertRaises(grpc.RpcError) as ctx:
                    pb_grpc.RouterStub(ch).Generate(request(), timeout=20)
            self.assertEqual(ctx.exception.code(), grpc.StatusCode.UNAVAILABLE)
            self.assertIn("certificate verify failed", ctx.exception.details())
        finally:
            r.stop()

    def test_backend_server_name_override(self):
        # Certificates name "specserve-internal"; dialling 127.0.0.1 with
        # that override succeeds, another name fails.
        good = self.router(ROUTER_BACKEND_MTLS + [
            "--backend_tls_server_name", "specserve-internal"])
        bad = self.router(ROUTER_BACKEND_MTLS + [
            "--backend_tls_server_name", "someone-else"])
        try:
            with grpc.insecure_channel(good.address) as ch:
                resp = pb_grpc.RouterStub(ch).Generate(request(), timeout=60)
            self.assertGreater(resp.usage.completion_tokens, 0)
            with grpc.insecure_channel(bad.address) as ch:
                with self.assertRaises(grpc.RpcError) as ctx:
                    pb_grpc.RouterStub(ch).Generate(request(), timeout=20)
            self.assertEqual(ctx.exception.code(), grpc.StatusCode.UNAVAILABLE)
        finally:
            good.stop()
            bad.stop()

    def test_z_restarted_services_are_used_again_over_tls(self):
        # Last (z): restarts the shared stack's services on their ports;
        # the router's TLS channels must reconnect and handshake again.
        creds = grpc.ssl_channel_credentials(
            root_certificates=read("ca.pem"), private_key=read("client.key"),
            certificate_chain=read("client.pem"))
        for name in ("speculator", "target"):
            old = getattr(self.stack, name)
            old.kill()
            argv = list(old.argv)
            argv[argv.index("--port") + 1] = str(old.port)
            new = Service(name, argv)
            self.stack.services[self.stack.services.index(old)] = new
            setattr(self.stack, name, new)
        deadline = time.time() + 20
        while True:
            try:
                resp = self.call(creds, request(keep_ratio=0.5), timeout=10)
                if not resp.stats.fallback_reason:
                    break
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
            self.assertLess(time.time(), deadline,
                            "restarted services not used again over TLS")
            time.sleep(0.2)
        self.assertGreater(resp.usage.completion_tokens, 0)
        self.assertLess(resp.usage.kept_prompt_tokens, resp.usage.prompt_tokens)


class TlsShutdownTest(unittest.TestCase):

    def test_tls_binaries_shut_down_cleanly_on_sigterm(self):
        # The TLS check starts gRPC threads early; SIGTERM must still reach
        # the graceful path (sigwait), not kill the process.
        if not os.path.isdir(CERTS):
            subprocess.run(["bash", "tests/make_test_certs.sh", CERTS], check=True)
        for name, rel, extra in [
                ("speculator", "speculator_service/speculator_service",
                 ["--model", "models/stories260K-draft"]),
                ("target", "target_service/target_service",
                 ["--model", "models/stories260K"]),
                ("router", "router/router",
                 ["--target", "127.0.0.1:1"] + ROUTER_BACKEND_MTLS)]:
            with self.subTest(name):
                s = Service(name, [find_binary(rel), "--port", "0",
                                   "--metrics_port", "0"] + extra + server_tls())
                s.proc.send_signal(signal.SIGTERM)
                self.assertEqual(s.proc.wait(timeout=20), 0, "".join(s.log))
                s._reader.join(5)
                self.assertIn("shutting down", "".join(s.log))


class TlsFlagErrorsTest(unittest.TestCase):

    def run_binary(self, rel, args):
        return subprocess.run([find_binary(rel)] + args, capture_output=True,
                              text=True, timeout=60)

    def test_missing_certificate_file_names_flag_and_path(self):
        missing = os.path.join(TMP, "no-such-cert.pem")
        for rel, extra in [("router/router", ["--target", "127.0.0.1:1"]),
                           ("speculator_service/speculator_service",
                            ["--model", "models/stories260K-draft"]),
                           ("target_service/target_service",
                            ["--model", "models/stories260K"])]:
            with self.subTest(rel):
                out = self.run_binary(rel, extra + [
                    "--port", "0", "--metrics_port", "0",
                    "--tls_cert_file", missing, "--tls_key_file", missing])
                self.assertEqual(out.returncode, 2, out.stderr)
                self.assertIn("--tls_cert_file", out.stderr)
                self.assertIn(missing, out.stderr)
                self.assertIn("NOT_FOUND", out.stderr)

    def test_cpp_client_flag_errors_name_flag_and_path(self):
        missing = os.path.join(TMP, "no-such-ca.pem")
        out = cpp_client("127.0.0.1:1", ["--tls_ca_file", missing])
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertIn("--tls_ca_file", out.stderr)
        self.assertIn(missing, out.stderr)
        self.assertIn("NOT_FOUND", out.stderr)
        out = cpp_client("127.0.0.1:1", ["--tls_cert_file", "/dev/null"])
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertIn("--tls_key_file", out.stderr)
        self.assertIn("INVALID_ARGUMENT", out.stderr)
        out = cpp_client("127.0.0.1:1", ["--tls_server_name", "x"])
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertIn("TLS is off", out.stderr)

    def test_python_client_flag_errors(self):
        out = python_client("127.0.0.1:1", ["--tls_cert_file", "/dev/null"])
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertIn("--tls_key_file", out.stderr)
        missing = os.path.join(TMP, "no-such-ca.pem")
        out = python_client("127.0.0.1:1", ["--tls_ca_file", missing])
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertIn(missing, out.stderr)
        with self.assertRaises(ValueError):
            specserve_client.make_channel("127.0.0.1:1", server_name="x")

    def test_router_client_certificate_without_key_is_rejected(self):
        out = self.run_binary("router/router", [
            "--target", "127.0.0.1:1", "--port", "0", "--metrics_port", "0",
            "--backend_tls_cert_file", "/dev/null"])
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertIn("--backend_tls_key_file", out.stderr)
        self.assertIn("INVALID_ARGUMENT", out.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)

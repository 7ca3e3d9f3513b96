"""TLS and mutual TLS between the real binaries over loopback (issue 17,
section 2): certificates made at test time by tests/make_test_certs.sh (the
openssl CLI); the speculator and target require client certificates from
the router, and the router's public port requires one from its clients.
"""

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

    def test_router_client_certificate_without_key_is_rejected(self):
        out = self.run_binary("router/router", [
            "--target", "127.0.0.1:1", "--port", "0", "--metrics_port", "0",
            "--backend_tls_cert_file", "/dev/null"])
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertIn("--backend_tls_key_file", out.stderr)
        self.assertIn("INVALID_ARGUMENT", out.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)

"""Bad input and open doors, against the real binaries on loopback: the
hardening findings of a review that tried the stack as a new user and then
as an attacker would. Each case asserts the answer the stack must give:

- oversized bodies, chunked or with a Content-Length, and an oversized
  prompt are refused fast without growing the router's memory;
- every gauge is back at its idle value right after the last request;
- the API key guards both the HTTP and the gRPC API; the metrics ports bind
  the services' --host; a POST must say it is JSON; the bearer scheme is
  case-insensitive; a malformed request is a client error, not a server
  error;
- stop conditions are bounded; fallbacks_total's reasons are a fixed set;
- many concurrent clients all get a speculator session (no fallback for
  want of one);
- a replica going down is logged once.

Bounded: the whole run takes about a minute on 2 cores. SOAK_REQUESTS
(environment, default 300) sets how many sequential requests the memory
soak sends; README's numbers come from SOAK_REQUESTS=10000.
"""

import concurrent.futures
import importlib
import json
import os
import re
import socket
import sys
import tempfile
import time
import unittest
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                "tools", "python"))
import grpc  # noqa: E402
import specserve_client  # noqa: E402
from stack import Stack, wait_until  # noqa: E402

pb, pb_grpc = specserve_client.load_stubs(
    os.path.join(os.environ.get("TEST_TMPDIR", tempfile.gettempdir()), "stubs"))
common_pb = importlib.import_module("protos.common_pb2")

KEY = "sk-test-key"
HOST = "127.0.0.1"
FALLBACK_REASONS = {
    "speculator_unavailable", "speculator_deadline", "speculator_busy",
    "speculator_error", "speculator_bad_response",
    "speculator_failed_mid_generation", "other"}


def free_port():
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def rss_bytes(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def listening_address(port):
    """Local IPv4 address (dotted) of the LISTEN socket on `port`, also when
    it is an IPv6 socket bound to a v4-mapped address; None if none."""
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(path) as f:
            next(f)
            for line in f:
                parts = line.split()
                addr, p = parts[1].split(":")
                if int(p, 16) != port or parts[3] != "0A":
                    continue
                if len(addr) == 32:  # tcp6: only v4-mapped ones are read
                    if not addr.startswith("0000000000000000FFFF0000"):
                        return addr
                    addr = addr[24:]
                raw = bytes.fromhex(addr)[::-1]
                return ".".join(str(b) for b in raw)
    return None


def raw_http(port, head, body_chunks=(), timeout=10.0):
    """Sends `head` then each chunk until the server answers or stops
    reading; returns (response bytes, body bytes sent). Returns as soon as a
    whole response (headers and Content-Length bytes) is in: a server that
    answers early need not close the connection for the answer to count."""
    sent = 0
    got = b""

    def complete(data):
        head_end = data.find(b"\r\n\r\n")
        if head_end < 0:
            return False
        m = re.search(rb"(?i)\r\ncontent-length: *(\d+)", data[:head_end])
        return m is not None and len(data) >= head_end + 4 + int(m.group(1))

    with socket.create_connection((HOST, port), timeout=timeout) as s:
        s.sendall(head)
        try:
            for chunk in body_chunks:
                s.setblocking(False)
                try:
                    got += s.recv(65536)
                    break  # answered (or closed) early
                except BlockingIOError:
                    pass
                finally:
                    s.setblocking(True)
                    s.settimeout(timeout)
                s.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            while not complete(got):
                b = s.recv(65536)
                if not b:
                    break
                got += b
        except (ConnectionResetError, socket.timeout):
            pass
    return got, sent


class BadInputTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.http_port = free_port()
        host = ["--host", HOST]
        cls.stack = Stack(router_args=host + ["--http_port", str(cls.http_port),
                                              "--api_key", KEY],
                          speculator_args=host, target_args=host)
        cls.router = cls.stack.router
        channel = grpc.insecure_channel(cls.router.address)
        cls.stub = pb_grpc.RouterStub(channel)
        cls.auth = (("authorization", "Bearer " + KEY),)

    @classmethod
    def tearDownClass(cls):
        cls.stack.close()

    def post(self, path, body, headers=None, timeout=30):
        h = {"Content-Type": "application/json",
             "Authorization": "Bearer " + KEY}
        h.update(headers or {})
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(
            "http://%s:%d%s" % (HOST, self.http_port, path), data=data,
            headers={k: v for k, v in h.items() if v is not None})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def complete(self, **fields):
        body = {"prompt": "Once upon a time", "max_tokens": 2}
        body.update(fields)
        return self.post("/v1/completions", body)

    # --- Oversized input: refused fast, router memory flat.

    def assert_refused_fast(self, what, fn, max_s=1.0, max_rss=50 << 20):
        fn()  # warm-up: allocator arenas, thread stacks
        before = rss_bytes(self.router.proc.pid)
        start = time.time()
        fn()
        took = time.time() - start
        grown = rss_bytes(self.router.proc.pid) - before
        print("%s: refused in %.3f s, router RSS %+.1f MB" % (
            what, took, grown / 1e6))
        self.assertLess(took, max_s, what)
        self.assertLess(grown, max_rss, what)

    def test_chunked_100mb_body_is_refused(self):
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                b"Content-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n")
        piece = b"a" * (1 << 20)
        chunk = b"%x\r\n" % len(piece) + piece + b"\r\n"

        def send():
            got, sent = raw_http(self.http_port, head, [chunk] * 100)
            self.assertLess(sent, 100 << 20, "the whole body was read")
            if got:
                self.assertTrue(got.startswith(b"HTTP/1.1 413"), got[:200])
        self.assert_refused_fast("100 MB chunked body", send)

    def test_content_length_100mb_body_is_refused(self):
        def send():
            head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                    b"Content-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n" % (100 << 20))
            got, _ = raw_http(self.http_port, head, [b"a" * (1 << 20)] * 100)
            self.assertTrue(got.startswith(b"HTTP/1.1 413"), got[:200])
        self.assert_refused_fast("100 MB Content-Length body", send)

    def test_8mb_prompt_is_refused_before_tokenizing(self):
        def send():
            code, body = self.complete(prompt="a " * 4000000)  # 8 MB
            self.assertEqual(code, 400, body)
            self.assertIn("before tokenizing", body["error"]["message"])
            self.assertEqual(body["error"]["param"], "prompt")
        self.assert_refused_fast("8 MB prompt", send)

    # --- Gauges at idle.

    def test_gauges_return_to_idle(self):
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(
                lambda i: self.complete(max_tokens=16, seed=i)[0], range(16)))
        self.assertEqual(codes, [200] * 16)
        idle = {
            self.stack.speculator: [
                "specserve_speculator_kv_cache_usage_perc",
                "specserve_speculator_num_requests_waiting"],
            self.stack.target: [
                "specserve_target_kv_cache_usage_perc",
                "specserve_target_kv_cache_bytes",
                "specserve_target_active_sessions",
                "specserve_target_num_requests_waiting"],
            self.router: ["specserve_router_in_flight_requests"],
        }
        start = time.time()
        for service, names in idle.items():
            for name in names:
                self.assertTrue(
                    wait_until(lambda: service.metric_value(name) == 0, 1.0),
                    "%s = %s" % (name, service.metric_value(name)))
        print("gauges idle %.2f s after the last request" % (
            time.time() - start))

    # --- Doors.

    def test_grpc_needs_the_api_key(self):
        req = pb.GenerateTextRequest(text="Once upon a time")
        req.sampling.max_new_tokens = 2
        with self.assertRaises(grpc.RpcError) as e:
            self.stub.Generate(req, timeout=10)
        self.assertEqual(e.exception.code(), grpc.StatusCode.UNAUTHENTICATED)
        with self.assertRaises(grpc.RpcError) as e:
            self.stub.Info(common_pb.InfoRequest(), timeout=10,
                           metadata=(("authorization", "Bearer wrong"),))
        self.assertEqual(e.exception.code(), grpc.StatusCode.UNAUTHENTICATED)
        resp = self.stub.Generate(req, timeout=20,
                                  metadata=(("authorization", "bearer " + KEY),))
        self.assertEqual(resp.usage.completion_tokens, 2)

    def test_metrics_ports_bind_the_host(self):
        for s in self.stack.services:
            self.assertEqual(listening_address(s.metrics_port), HOST, s.name)
            self.assertEqual(listening_address(s.port), HOST, s.name)
        self.assertEqual(listening_address(self.http_port), HOST)

    def test_posts_must_be_json(self):
        for ctype in (None, "text/plain", "application/x-www-form-urlencoded"):
            code, body = self.post(
                "/v1/completions", {"prompt": "a", "max_tokens": 1},
                headers={"Content-Type": ctype})
            self.assertEqual(code, 415, (ctype, body))
            self.assertEqual(body["error"]["type"], "invalid_request_error")
        code, _ = self.post("/v1/completions", {"prompt": "a", "max_tokens": 1},
                            headers={"Content-Type":
                                     "application/json; charset=utf-8"})
        self.assertEqual(code, 200)

    def test_bearer_scheme_is_case_insensitive(self):
        for scheme in ("Bearer", "bearer", "BEARER"):
            code, body = self.post(
                "/v1/completions", {"prompt": "a", "max_tokens": 1},
                headers={"Authorization": "%s %s" % (scheme, KEY)})
            self.assertEqual(code, 200, (scheme, body))
        code, _ = self.post("/v1/completions", {"prompt": "a"},
                            headers={"Authorization": "Basic " + KEY})
        self.assertEqual(code, 401)

    def test_malformed_http_is_a_client_error(self):
        got, _ = raw_http(self.http_port, b"GARBAGE\r\n\r\n")
        self.assertTrue(got.startswith(b"HTTP/1.1 400"), got[:200])
        body = json.loads(got.split(b"\r\n\r\n", 1)[1])
        self.assertEqual(body["error"]["type"], "invalid_request_error")
        self.assertEqual(body["error"]["code"], "INVALID_ARGUMENT")

    # --- Bounded inputs and labels.

    def test_stop_conditions_are_bounded(self):
        code, body = self.complete(stop=["x%d" % i for i in range(200000)])
        self.assertEqual(code, 400, body)
        self.assertIn("at most 16", body["error"]["message"])
        code, body = self.complete(stop=["a" * 300])
        self.assertEqual(code, 400, body)
        code, body = self.complete(stop_token_ids=list(range(65)))
        self.assertEqual(code, 400, body)
        code, _ = self.complete(stop=["x%d" % i for i in range(16)])
        self.assertEqual(code, 200)

    # --- Load: every concurrent request gets a speculator session.

    def test_many_clients_keep_speculation(self):
        def one(i):
            return self.complete(prompt="Once upon a time %d" % i, max_tokens=4,
                                 seed=i)
        with concurrent.futures.ThreadPoolExecutor(128) as pool:
            results = list(pool.map(one, range(256)))
        reasons = {}
        for code, body in results:
            self.assertEqual(code, 200, body)
            r = body["specserve"].get("fallback_reason", "")
            if r:
                reasons[r] = reasons.get(r, 0) + 1
        print("256 requests, 128 clients: fallbacks %s" % reasons)
        self.assertNotIn("speculator_busy", reasons)
        text = self.router.metrics()
        labels = set(re.findall(
            r'specserve_router_fallbacks_total\{reason="([^"]*)"\}', text))
        self.assertLessEqual(labels, FALLBACK_REASONS)

    # --- Memory stays flat over many requests.

    def test_rss_is_flat_over_sequential_requests(self):
        n = int(os.environ.get("SOAK_REQUESTS", "300"))
        # Warm-up: past the HTTP server's 520 connection threads (the
        # router's 512 concurrent requests + 8), each of which touches its
        # stack and allocator arena the first time a connection lands on
        # it; after that RSS must stay flat.
        for i in range(1000):
            self.complete(max_tokens=1, seed=i)
        before = rss_bytes(self.router.proc.pid)
        start = time.time()
        for i in range(n):
            code, _ = self.complete(max_tokens=1, seed=i)
            self.assertEqual(code, 200)
        grown = rss_bytes(self.router.proc.pid) - before
        print("%d requests in %.1f s: router RSS %+.2f MB (%.3f MB per 1,000)"
              % (n, time.time() - start, grown / 1e6, grown / 1e6 * 1000 / n))
        self.assertLess(grown, max(2 << 20, n * 1024))

    # Last (the suite's stack loses its speculator): a replica going down
    # is logged once.
    def test_zz_replica_down_is_logged_once(self):
        addr = self.stack.speculator.address
        self.stack.speculator.stop()
        for i in range(3):
            code, body = self.complete(seed=i)
            self.assertEqual(code, 200, body)
        pattern = "speculator replica %s is unreachable" % addr
        self.assertTrue(wait_until(
            lambda: any(pattern in line for line in self.router.log), 5.0),
            "".join(self.router.log[-20:]))
        time.sleep(2.5)  # two more health checks
        self.assertEqual(
            sum(pattern in line for line in self.router.log), 1,
            "".join(self.router.log[-20:]))


if __name__ == "__main__":
    unittest.main(verbosity=2)

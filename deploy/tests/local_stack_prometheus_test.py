"""Integration: the local stack (speculator, target and router binaries on
loopback with the bundled stories260K pair) and a real Prometheus server
scraping all three every second with deploy/prometheus's rules. Requests go
through the router; the acceptance-rate and keep-ratio recording rules read
back through Prometheus' HTTP API must equal what the router told the
clients. Every rule must evaluate cleanly and every dashboard query must run.
A hard deadline (DEADLINE_S) bounds the whole test; everything started is
killed on exit.
"""

import atexit
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import unittest
import urllib.parse
import urllib.request

sys.path[:0] = ["tests", "tools/python"]
from stack import Stack  # noqa: E402
import specserve_client  # noqa: E402

DEADLINE_S = 120
PROMPT = ("Once upon a time, there was a little girl named Lily. She loved to "
          "play outside in the sunshine. One day, she saw a big red ball in the "
          "park. She ran to the ball and kicked it very high. The ball flew over "
          "the trees and Lily laughed. Her mom smiled and said it was time to go.")
# Labelled counters with no sample until their first increment.
MAY_BE_ABSENT = {"specserve_router_fallbacks_total"}
METRIC = re.compile(r"\bspecserve_[a-z0-9_]+")


class Deadline(Exception):
    pass


def on_alarm(*_):
    raise Deadline("local stack + Prometheus test passed its %d s deadline" % DEADLINE_S)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """A Prometheus server on loopback with a generated config."""

    def __init__(self, targets, workdir):
        self.port = free_port()
        rules = [os.path.abspath("deploy/prometheus/" + f)
                 for f in ("recording_rules.yml", "alert_rules.yml")]
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": rules,
            "scrape_configs": [{
                "job_name": "specserve",
                "static_configs": [{"targets": ["127.0.0.1:%d" % port],
                                    "labels": {"component": name}}
                                   for name, port in targets.items()]}],
        }
        path = os.path.join(workdir, "prometheus.yml")
        with open(path, "w") as f:
            json.dump(config, f)  # JSON is YAML
        self.log_path = os.path.join(workdir, "prometheus.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            ["prometheus", "--config.file=" + path,
             "--storage.tsdb.path=" + os.path.join(workdir, "tsdb"),
             "--web.listen-address=127.0.0.1:%d" % self.port],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def get(self, path, **params):
        url = "http://127.0.0.1:%d%s" % (self.port, path)
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read().decode()) if path.startswith("/api") else r.status

    def query(self, expr):
        """Instant query -> [(labels, float)]; raises on a PromQL error."""
        reply = self.get("/api/v1/query", query=expr)
        if reply["status"] != "success":
            raise AssertionError("%s: %s" % (expr, reply))
        if reply["data"]["resultType"] == "scalar":
            return [({}, float(reply["data"]["result"][1]))]
        return [(r["metric"], float(r["value"][1])) for r in reply["data"]["result"]]

    def value(self, expr):
        """The single sample of expr, or None while it has none (or NaN)."""
        rows = self.query(expr)
        if len(rows) != 1 or math.isnan(rows[0][1]):
            return None
        return rows[0][1]

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def poll(predicate, interval=0.5):
    """Polls until predicate() is truthy; the alarm bounds it."""
    while True:
        try:
            result = predicate()
        except (OSError, ValueError):
            result = None
        if result:
            return result
        time.sleep(interval)


class LocalStackPrometheusTest(unittest.TestCase):

    def test_recording_rules_match_the_router(self):
        work = os.environ.get("TEST_TMPDIR", "/tmp")
        signal.signal(signal.SIGALRM, on_alarm)
        signal.alarm(DEADLINE_S)
        stack = prom = None
        try:
            stack = Stack()
            atexit.register(stack.close)
            prom = Prometheus({"router": stack.router.metrics_port,
                               "speculator": stack.speculator.metrics_port,
                               "target": stack.target.metrics_port}, work)
            atexit.register(prom.stop)
            self.run_checks(stack, prom, work)
        except Deadline:
            log = open(prom.log_path).read()[-3000:] if prom else ""
            self.fail("deadline passed; Prometheus log tail:\n" + log)
        finally:
            signal.alarm(0)
            if prom:
                prom.stop()
            if stack:
                stack.close()

    def run_checks(self, stack, prom, work):
        poll(lambda: prom.get("/-/ready") == 200)
        # All three targets up and scraped at least twice before any request,
        # so every counter's first sample is its idle value.
        poll(lambda: sorted(v for _, v in prom.query('up{job="specserve"}')) == [1, 1, 1])
        poll(lambda: (prom.value(
            "count_over_time(specserve_router_prompt_tokens_total[1m])") or 0) >= 2)
        time.sleep(1.5)

        router_pb2, router_grpc = specserve_client.load_stubs(os.path.join(work, "stubs"))
        import grpc
        prompt = kept = drafted = accepted = 0
        with grpc.insecure_channel(stack.router.address) as channel:
            stub = router_grpc.RouterStub(channel)
            for keep_ratio, k in ((0.3, 4), (0.5, 2), (0.3, 6)):
                req = specserve_client.build_request(
                    router_pb2, prompt=PROMPT, max_new_tokens=24, temperature=0.0,
                    keep_ratio=keep_ratio, num_draft_tokens=k)
                req.speculative_prefill.chunk_size = 8
                resp = stub.Generate(req, timeout=30)
                u, s = resp.usage, resp.stats
                self.assertEqual(s.fallback_reason, "", resp)
                self.assertLess(0, u.kept_prompt_tokens)
                self.assertLess(u.kept_prompt_tokens, u.prompt_tokens)
                self.assertGreater(s.num_draft_tokens, 0)
                prompt += u.prompt_tokens
                kept += u.kept_prompt_tokens
                drafted += s.num_draft_tokens
                accepted += s.num_accepted_tokens
        want = {"specserve:keep_ratio:ratio_rate5m": kept / prompt,
                "specserve:spec_decode_acceptance_rate:ratio_rate5m": accepted / drafted}
        self.assertGreater(accepted, 0)
        last = {}

        def converged():
            for series, value in want.items():
                last[series] = prom.value(series)
                if last[series] is None or not math.isclose(last[series], value, rel_tol=1e-6):
                    return False
            return True
        try:
            poll(converged)
        except Deadline:
            raise AssertionError("recording rules %s never reached %s" % (last, want))
        keep = last["specserve:keep_ratio:ratio_rate5m"]
        acceptance = last["specserve:spec_decode_acceptance_rate:ratio_rate5m"]
        self.assertTrue(0 < keep < 1, keep)
        self.assertTrue(0 < acceptance <= 1, acceptance)
        print("Prometheus: keep ratio %.4f, acceptance rate %.4f" % (keep, acceptance))

        # The speculator scored exactly the prompts the router reported (its
        # scrape may land up to an interval after the router's).
        speculator = {"sum(specserve_speculator_prompt_tokens_total)": prompt,
                      "sum(specserve_speculator_kept_tokens_total)": kept}
        try:
            poll(lambda: all(prom.value(q) == v for q, v in speculator.items()))
        except Deadline:
            raise AssertionError("speculator counters %s never reached %s" % (
                [prom.value(q) for q in speculator], list(speculator.values())))
        mal = prom.value("specserve:spec_decode_mean_acceptance_length:rate5m")
        self.assertIsNotNone(mal)
        self.assertGreaterEqual(mal, 1)

        # Every rule evaluates cleanly against the live series.
        groups = prom.get("/api/v1/rules")["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        self.assertGreaterEqual(len(rules), 10)
        for r in rules:
            self.assertEqual(r["health"], "ok", r)
        # Every metric the rules (expressions and annotations) and the
        # dashboard name is really exported.
        names = set(prom.get("/api/v1/label/__name__/values")["data"])
        with open("deploy/grafana/specserve-dashboard.json") as f:
            dashboard = json.load(f)
        exprs = [t["expr"].replace("$__rate_interval", "1m")
                 for p in dashboard["panels"] for t in p["targets"]]
        referenced = set()
        for path in ("deploy/prometheus/recording_rules.yml", "deploy/prometheus/alert_rules.yml"):
            with open(path) as f:
                referenced |= set(METRIC.findall(f.read()))
        for e in exprs:
            referenced |= set(METRIC.findall(e))
        # (A histogram's family name, as in annotations, shows as _bucket.)
        missing = {n for n in referenced - MAY_BE_ABSENT
                   if n not in names and n + "_bucket" not in names}
        self.assertFalse(missing, "named in rules/dashboard but not exported: %s" % missing)
        # Every dashboard query runs.
        for e in exprs:
            prom.query(e)


if __name__ == "__main__":
    unittest.main()

"""Faults under load: the real binaries on loopback
with 64 streams in flight while the speculator is killed (kill -9) and
restarted, then frozen (SIGSTOP) for 10 s and resumed, then the target is
killed and restarted.

What must hold: a request either completes (speculator faults fall back to
full prefill and plain decoding) or, only while the target is down, fails
with UNAVAILABLE or DEADLINE_EXCEEDED within its deadline; a restarted
replica is used again; nothing hangs; and afterwards the active-session
gauges of all three services return to 0 (no leaked session). Bounded: the
whole run takes well under 3 minutes on 2 cores.
"""

import collections
import os
import signal
import sys
import tempfile
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                "tools", "python"))
import grpc  # noqa: E402
import specserve_client  # noqa: E402
from stack import Service, Stack, find_binary, wait_until  # noqa: E402

pb, pb_grpc = specserve_client.load_stubs(
    os.path.join(os.environ.get("TEST_TMPDIR", tempfile.gettempdir()), "stubs"))

STREAMS = 64
DEADLINE_S = 20.0        # every request's gRPC deadline
DEADLINE_SLACK_S = 2.0   # a failure must come by deadline + this
SPECULATOR_DEADLINE_MS = 1000
STOP_S = 10.0            # SIGSTOP length
CLEAN_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

PROMPTS = [
    "Sue loved her garden. She had red flowers and a little green plant.",
    "Once upon a time there was a little dog named Max. Max liked to run.",
    "Tom and his mom went to the park. They saw a big tree and a bird.",
    "Lily had a red ball. One day the ball rolled into the pond.",
]


class Outcome:
    __slots__ = ("prompt", "greedy", "start", "end", "code", "details",
                 "finish", "fallback", "tokens", "ids", "prompt_tokens", "kept")

    def __init__(self, prompt, greedy, start):
        self.prompt = prompt
        self.greedy = greedy
        self.ids = []
        self.prompt_tokens = self.kept = 0
        self.start = start
        self.end = None
        self.code = grpc.StatusCode.OK
        self.details = ""
        self.finish = ""
        self.fallback = ""
        self.tokens = 0

    def __repr__(self):
        return "Outcome(%.2f..%.2f %s %r finish=%r fallback=%r tokens=%d)" % (
            self.start, self.end or -1, self.code, self.details, self.finish,
            self.fallback, self.tokens)


class Load:
    """STREAMS workers, each sending GenerateStream requests back to back
    until stop(); every request's outcome is recorded."""

    def __init__(self, address):
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.RouterStub(self.channel)
        self.lock = threading.Lock()
        self.outcomes = []
        self.active = 0
        self._stop = threading.Event()
        self.threads = [threading.Thread(target=self._worker, args=(i,),
                                         daemon=True) for i in range(STREAMS)]
        for t in self.threads:
            t.start()

    def _worker(self, i):
        n = 0
        while not self._stop.is_set():
            n += 1
            # Greedy requests keep the whole prompt, so every one of them,
            # drafted or not, must equal the target alone; sampled ones
            # prune half of it.
            greedy = i % 2 == 1
            prompt = (i + n) % len(PROMPTS)
            req = specserve_client.build_request(
                pb, prompt=PROMPTS[prompt], max_new_tokens=48,
                temperature=0.0 if greedy else 0.8, seed=i * 1000 + n,
                keep_ratio=1.0 if greedy else 0.5, num_draft_tokens=4)
            o = Outcome(prompt, greedy, time.time())
            with self.lock:
                self.active += 1
            try:
                for chunk in self.stub.GenerateStream(req, timeout=DEADLINE_S):
                    o.tokens += len(chunk.token_ids)
                    o.ids += chunk.token_ids
                    if chunk.finish_reason:
                        o.finish = chunk.finish_reason
                        o.fallback = chunk.stats.fallback_reason
                        o.prompt_tokens = chunk.usage.prompt_tokens
                        o.kept = chunk.usage.kept_prompt_tokens
            except grpc.RpcError as e:
                o.code, o.details = e.code(), e.details()
            o.end = time.time()
            with self.lock:
                self.active -= 1
                self.outcomes.append(o)
            if o.code != grpc.StatusCode.OK:
                time.sleep(0.05)  # no busy loop while the target is down

    def in_flight(self):
        with self.lock:
            return self.active

    def served_since(self, t, spec_used):
        """True once a request started after `t` completed, with the
        speculator's help (no fallback) if `spec_used`."""
        with self.lock:
            return any(o.start > t and o.code == grpc.StatusCode.OK and
                       (not spec_used or not o.fallback)
                       for o in self.outcomes)

    def stop(self, timeout):
        """Stops the workers; False if any is still running after `timeout`."""
        self._stop.set()
        end = time.time() + timeout
        for t in self.threads:
            t.join(max(0.0, end - time.time()))
        alive = any(t.is_alive() for t in self.threads)
        self.channel.close()
        return not alive


def signal_group(service, sig):
    os.killpg(service.proc.pid, sig)


def restart(stack, service):
    """Starts `service` again on the same gRPC port (the router's replica
    list names it); returns the new Service, stopped with the stack."""
    argv = list(service.argv)
    argv[argv.index("--port") + 1] = str(service.port)
    new = Service(service.name, argv)
    stack.services[stack.services.index(service)] = new
    return new


class FaultsUnderLoadTest(unittest.TestCase):

    def test_faults_under_load(self):
        t_begin = time.time()
        with Stack(router_args=["--speculator_deadline_ms",
                                str(SPECULATOR_DEADLINE_MS)]) as stack:
            load = Load(stack.router.address)
            events = {}
            try:
                self.run_faults(stack, load, events)
            finally:
                self.assertTrue(load.stop(DEADLINE_S + DEADLINE_SLACK_S + 5),
                                "a client request hung past its deadline")
            self.check_outcomes(load.outcomes, events)
            self.check_no_leaks(stack)
        elapsed = time.time() - t_begin
        print("faults test: %d requests in %.1f s" % (len(load.outcomes),
                                                       elapsed))
        self.assertLess(elapsed, 170)

    def wait_in_flight(self, load):
        self.assertTrue(wait_until(lambda: load.in_flight() >= STREAMS - 4,
                                   timeout=10), load.in_flight())
        return load.in_flight()

    def run_faults(self, stack, load, events):
        # Warm: the speculator helps.
        self.assertTrue(wait_until(lambda: load.served_since(0, True), 30),
                        load.outcomes[-5:])
        # 1. kill -9 the speculator; requests fall back; restart it.
        print("in flight at speculator kill:", self.wait_in_flight(load))
        events["spec_kill"] = time.time()
        stack.speculator.kill(signal.SIGKILL)
        time.sleep(3)
        stack.speculator = restart(stack, stack.speculator)
        events["spec_restart"] = time.time()
        self.assertTrue(wait_until(
            lambda: load.served_since(events["spec_restart"], True), 20),
            "the restarted speculator is not used again")
        # 2. SIGSTOP the speculator for 10 s, then SIGCONT.
        print("in flight at speculator stop:", self.wait_in_flight(load))
        events["spec_stop"] = time.time()
        signal_group(stack.speculator, signal.SIGSTOP)
        time.sleep(STOP_S)
        signal_group(stack.speculator, signal.SIGCONT)
        events["spec_cont"] = time.time()
        with load.lock:
            during = [o for o in load.outcomes
                      if events["spec_stop"] + 2 < o.start
                      and o.end < events["spec_cont"]]
        self.assertTrue(during, "no request completed while frozen")
        self.assertTrue(all(o.code == grpc.StatusCode.OK and o.fallback
                            for o in during), during[:5])
        self.assertTrue(wait_until(
            lambda: load.served_since(events["spec_cont"], True), 20),
            "the resumed speculator is not used again")
        # 3. kill -9 the target; restart it.
        print("in flight at target kill:", self.wait_in_flight(load))
        events["target_kill"] = time.time()
        stack.target.kill(signal.SIGKILL)
        time.sleep(2)
        stack.target = restart(stack, stack.target)
        events["target_restart"] = time.time()
        self.assertTrue(wait_until(
            lambda: load.served_since(events["target_restart"], False), 20),
            "the restarted target is not used again")
        time.sleep(1)

    def check_outcomes(self, outcomes, events):
        self.assertGreater(len(outcomes), STREAMS)
        bad, late = [], []
        for o in outcomes:
            if o.end - o.start > DEADLINE_S + DEADLINE_SLACK_S:
                late.append(o)
            if o.code == grpc.StatusCode.OK:
                if not o.finish or o.tokens == 0:
                    bad.append(o)
                continue
            # Failures only for requests the target's outage touched.
            touched = (o.end >= events["target_kill"] and
                       o.start <= events["target_restart"] + 2)
            if o.code not in CLEAN_CODES or not touched:
                bad.append(o)
        self.assertEqual(late, [], "requests past their deadline")
        self.assertEqual(bad, [], "requests that neither completed nor "
                         "failed cleanly during the target outage")
        # Losslessness under faults: each prompt's greedy completions agree,
        # whether drafted, fallen back before Score or mid-generation.
        for p in range(len(PROMPTS)):
            greedy = {tuple(o.ids) for o in outcomes
                      if o.code == grpc.StatusCode.OK and o.greedy and o.prompt == p}
            self.assertEqual(len(greedy), 1, (p, greedy))
        # A fallback before Score prefills the full prompt.
        for o in outcomes:
            if o.fallback.startswith("speculator_") and not o.fallback.startswith(
                    "speculator_failed_mid_generation"):
                self.assertEqual(o.kept, o.prompt_tokens, o)
        fell_back = sum(1 for o in outcomes if o.fallback)
        failed = sum(1 for o in outcomes if o.code != grpc.StatusCode.OK)
        self.assertGreater(fell_back, 0)
        self.assertGreater(failed, 0)  # the target kill hit streams
        print("outcomes: %d ok (%d fell back), %d failed cleanly" % (
            len(outcomes) - failed, fell_back, failed))
        print("by reason:", collections.Counter(
            o.fallback if o.code == grpc.StatusCode.OK else str(o.code)
            for o in outcomes).most_common())

    def check_no_leaks(self, stack):
        gauges = [(stack.router, "specserve_router_in_flight_requests"),
                  (stack.speculator, "specserve_speculator_active_sessions"),
                  (stack.target, "specserve_target_active_sessions")]

        def drained():
            return all((s.metric_value(name) or 0) == 0 for s, name in gauges)

        ok = wait_until(drained, timeout=15, interval=0.2)
        self.assertTrue(ok, [(name, s.metric_value(name)) for s, name in gauges])


class StopSignalTest(unittest.TestCase):

    def test_sigterm_right_after_ready_shuts_down_cleanly(self):
        """SIGTERM is a stop request, whichever thread the kernel hands it
        to: OpenBLAS starts its threads before main() blocks the signal, and
        one of them could take it and kill the process (exit -15, no
        graceful drain; deterministic check: //common/service:
        server_main_test)."""
        for name, rel, extra in [
                ("speculator", "speculator_service/speculator_service",
                 ["--model", "models/stories260K-draft"]),
                ("target", "target_service/target_service",
                 ["--model", "models/stories260K"]),
                ("router", "router/router", ["--target", "127.0.0.1:1"])]:
            with self.subTest(name):
                s = Service(name, [find_binary(rel), "--port", "0",
                                   "--metrics_port", "0"] + extra)
                s.proc.send_signal(signal.SIGTERM)
                self.assertEqual(s.proc.wait(timeout=20), 0, "".join(s.log))
                s._reader.join(5)
                self.assertIn("shutting down", "".join(s.log))


if __name__ == "__main__":
    unittest.main(verbosity=2)

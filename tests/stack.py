"""Starts the real specserve binaries (speculator, target, router) on
loopback with free ports, for end-to-end tests, benchmarks and the
quickstart. Each binary prints "listening on <port>, metrics on <port>" on
stderr once ready; Stack waits for that line with a deadline.
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

READY = re.compile(r"listening on (\d+), metrics on (\d+)")


def find_binary(rel):
    """Locates a Bazel-built binary: runfiles first, then bazel-bin."""
    candidates = []
    for root in (os.environ.get("RUNFILES_DIR"), os.environ.get("TEST_SRCDIR")):
        if root:
            candidates.append(os.path.join(root, "specserve", rel))
    candidates.append(os.path.join(os.getcwd(), rel))
    candidates.append(os.path.join(os.getcwd(), "bazel-bin", rel))
    for c in candidates:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise FileNotFoundError("binary %s not found in %s" % (rel, candidates))


class Service:
    """One running binary; `port` and `metrics_port` once ready."""

    def __init__(self, name, argv, timeout=60.0, log_dir=None):
        self.name = name
        self.argv = argv
        self.port = None
        self.metrics_port = None
        self.log = []
        self._ready = threading.Event()
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._ready.wait(timeout) or self.port is None:
            self.kill()
            raise RuntimeError("%s did not become ready within %.0f s:\n%s" % (
                name, timeout, "".join(self.log[-30:])))

    def _read(self):
        for line in self.proc.stderr:
            self.log.append(line)
            m = READY.search(line)
            if m and self.port is None:
                self.port, self.metrics_port = int(m.group(1)), int(m.group(2))
                self._ready.set()
        self._ready.set()

    @property
    def address(self):
        return "127.0.0.1:%d" % self.port

    def metrics(self):
        """The service's /metrics text."""
        url = "http://127.0.0.1:%d/metrics" % self.metrics_port
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.read().decode()

    def metric_value(self, name):
        """Sum of every sample of `name` (any labels), or None if absent."""
        total, found = 0.0, False
        for line in self.metrics().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
                found = True
        return total if found else None

    def alive(self):
        return self.proc.poll() is None

    def kill(self, sig=signal.SIGKILL):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self):
        """SIGTERM (clean shutdown), SIGKILL if it takes over 10 s."""
        self.kill(signal.SIGTERM)


class Stack:
    """speculator + target + router on loopback, bundled models by default."""

    def __init__(self, speculator_model="models/stories260K-draft",
                 target_model="models/stories260K",
                 tokenizer="models/stories260K", router_args=(),
                 speculator_args=(), target_args=(), router_port=0,
                 metrics_ports=(0, 0, 0)):
        """metrics_ports: (speculator, target, router); 0 = any free port."""
        self.services = []
        try:
            self.speculator = self._start(
                "speculator", [find_binary("speculator_service/speculator_service"),
                               "--model", speculator_model, "--port", "0",
                               "--metrics_port", str(metrics_ports[0])] +
                list(speculator_args))
            self.target = self._start(
                "target", [find_binary("target_service/target_service"),
                           "--model", target_model, "--port", "0",
                           "--metrics_port", str(metrics_ports[1])] +
                list(target_args))
            self.router = self._start(
                "router", [find_binary("router/router"), "--port", str(router_port),
                           "--metrics_port", str(metrics_ports[2]),
                           "--speculator", self.speculator.address,
                           "--target", self.target.address,
                           "--tokenizer", tokenizer] + list(router_args))
        except Exception:
            self.close()
            raise

    def _start(self, name, argv):
        s = Service(name, argv)
        self.services.append(s)
        return s

    def close(self):
        for s in reversed(self.services):
            s.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def wait_until(predicate, timeout, interval=0.05):
    """Polls predicate() until true or `timeout` seconds pass."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()

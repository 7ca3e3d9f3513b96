"""Helpers shared by the deploy/ tests: rendering the kustomize overlays,
checking flags against the real binaries, and locating files.

Tests run from the Bazel runfiles root, so `deploy/...`, `models/...` and
the binaries (`router/router`, ...) open directly.
"""

import os
import re
import shutil
import subprocess
import tempfile

import yaml

OVERLAYS = ("local-cpu", "gpu", "local-cpu-tls")
# Component (image basename, Dockerfile name, k8s label) -> Bazel binary.
BINARIES = {
    "router": "router/router",
    "speculator": "speculator_service/speculator_service",
    "target": "target_service/target_service",
}
_ERROR = re.compile(r"^ERROR: (.*)$", re.M)
_FLAG = re.compile(r"^\s+--([A-Za-z0-9_]+) \(", re.M)


def tmpdir():
    return tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))


def render(overlay):
    """`kubectl kustomize` of deploy/k8s/overlays/<overlay> as a list of dicts.

    The tree is copied first: kustomize refuses files whose real path (the
    runfiles symlinks point into the source tree) is outside the root.
    """
    root = os.path.join(tmpdir(), "k8s")
    shutil.copytree("deploy/k8s", root)
    out = subprocess.run(
        ["kubectl", "kustomize", os.path.join(root, "overlays", overlay)],
        check=True, capture_output=True, text=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def repo_root():
    """The source tree (for files no Bazel target exports, e.g. WORKSPACE):
    runfiles are symlinks into it."""
    root = os.path.realpath("deploy/docker/bundle.sh")
    for _ in range(3):
        root = os.path.dirname(root)
    if not os.path.isfile(os.path.join(root, "WORKSPACE")):
        raise RuntimeError("no WORKSPACE above %s" % root)
    return root


def parse_flagfile(text):
    """Abseil flagfile -> list of '--flag=value' lines (comments dropped)."""
    return [l.strip() for l in text.splitlines()
            if l.strip() and not l.strip().startswith("#")]


def flag_map(args):
    """['--a=1', '--b', '2', '--nob'] -> {'a': '1', 'b': '2', 'nob': None};
    later flags win, as in Abseil."""
    out, i = {}, 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--"):
            raise ValueError("not a flag: %r" % a)
        name, eq, value = a[2:].partition("=")
        if not eq and i + 1 < len(args) and not args[i + 1].startswith("--"):
            value, i = args[i + 1], i + 1
        out[name] = value if (eq or value) else None
        i += 1
    return out


def check_with_binary(component, args):
    """Runs the real binary's Abseil parser on `args` (`--helpfull` stops it
    before it starts serving). Returns the parser's errors (unknown flags,
    bad values, unreadable flagfiles) as a list of strings."""
    binary = BINARIES[component]
    if not os.path.isfile(binary):
        return ["binary %s is missing from the runfiles" % binary]
    p = subprocess.run([binary] + list(args) + ["--helpfull"],
                       capture_output=True, text=True, timeout=60)
    text = p.stdout + p.stderr
    errors = _ERROR.findall(text)
    if not errors and not _FLAG.search(text):
        errors.append("no --helpfull output from %s: %s" % (binary, text[-500:]))
    return errors

"""Checks the Dockerfiles without a Docker engine: what they COPY exists in
the repository and covers every package the Bazel target needs (from a
genquery of its deps), the binary they build and run and the flags they pass
are the real ones (the binary's own parser), the ports agree with the k8s
base flags, the runtime stage is non-root with /models mounted, and
bundle.sh really produces a self-contained lib directory.

  dockerfile_test.py COMPONENT=DEPS_QUERY_FILE ...
"""

import json
import os
import re
import shlex
import subprocess
import sys
import unittest

import deploy_util as du

DEPS = {}  # component -> genquery output (packages the binary needs)
SYSTEM_LIBS = re.compile(
    r"^(linux-vdso|ld-linux|libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s"
    r"|libcuda|libcudart|libcublas|libcublasLt|libnvidia-[a-z]+)\.so")


def instructions(path):
    """[(INSTRUCTION, argument text)] with continuations joined."""
    out, buf = [], ""
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not buf and (not line.strip() or line.lstrip().startswith("#")):
                continue
            if line.endswith("\\"):
                buf += line[:-1] + " "
                continue
            buf += line
            word, _, rest = buf.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            buf = ""
    return out


def exec_form(arg):
    return json.loads(arg) if arg.startswith("[") else shlex.split(arg)


class Dockerfile:
    def __init__(self, component):
        self.component = component
        self.path = "deploy/docker/%s.Dockerfile" % component
        self.ins = instructions(self.path)
        self.args = {}
        self.stages = []  # [(name, [(instr, arg)])]
        for word, arg in self.ins:
            if word == "ARG" and not self.stages:
                name, _, default = arg.partition("=")
                self.args[name] = default
            elif word == "FROM":
                parts = arg.split()
                name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None
                self.stages.append((name, parts[0], []))
            else:
                self.stages[-1][2].append((word, arg))

    def final(self):
        return self.stages[-1]


class DockerfileTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.root = du.repo_root()
        cls.files = {c: Dockerfile(c) for c in du.BINARIES}

    def test_bases_stages_and_user(self):
        for comp, d in self.files.items():
            self.assertEqual(d.args["BUILD_IMAGE"], "debian:bookworm", comp)
            runtime = d.args["RUNTIME_IMAGE"]
            if comp == "router":
                self.assertEqual(runtime, "debian:bookworm-slim")
            else:
                self.assertRegex(runtime, r"^nvidia/cuda:[0-9.]+-runtime-ubuntu", comp)
            self.assertEqual([s[1] for s in d.stages], ["${BUILD_IMAGE}", "${RUNTIME_IMAGE}"])
            self.assertEqual(d.stages[0][0], "build", comp)
            final = d.final()[2]
            users = [a for w, a in final if w == "USER"]
            self.assertEqual(len(users), 1, comp)
            uid = users[0].split(":")[0]
            self.assertTrue(uid.isdigit() and int(uid) != 0, users)
            self.assertIn(("VOLUME", '["/models"]'), final, comp)
            # Models are mounted, never copied into an image (nor is the
            # whole context, which holds models/).
            for _, _, body in d.stages:
                for w, a in body:
                    parts = a.split()
                    if w not in ("COPY", "ADD") or parts[0].startswith("--from"):
                        continue
                    for src in parts[:-1]:
                        src = os.path.normpath(src)
                        self.assertFalse(src in (".", "models") or src.startswith("models/"),
                                         "%s: COPY %s" % (comp, src))

    def test_copy_sources_exist_and_cover_the_build(self):
        for comp, d in self.files.items():
            name, _, build = d.stages[0]
            copied = []
            for w, a in build:
                self.assertNotEqual(w, "ADD", comp)
                if w != "COPY":
                    continue
                parts = a.split()
                self.assertFalse(parts[0].startswith("--from"), comp)
                for src in parts[:-1]:
                    path = os.path.join(self.root, src)
                    self.assertTrue(os.path.exists(path), "%s: COPY %s: no such file" % (comp, src))
                    copied.append(src.rstrip("/"))
            for f in ("WORKSPACE", ".bazelrc", "tools/install_deps.sh", "deploy/docker/bundle.sh"):
                self.assertIn(f, copied, comp)
            # Every package of the binary's dependency graph is copied;
            # external repositories map to local_repository paths.
            with open(os.path.join(self.root, "WORKSPACE")) as f:
                local = dict(re.findall(
                    r'local_repository\(\s*name\s*=\s*"([^"]+)",\s*path\s*=\s*"([^"]+)"', f.read()))
            with open(DEPS[comp]) as f:
                packages = f.read().split()
            for pkg in packages:
                if pkg.startswith("@"):
                    repo = pkg[1:].split("//")[0]
                    if repo not in local:
                        continue  # Bazel's own (@bazel_tools, @local_config_cc)
                    pkg = local[repo]
                self.assertTrue(any(pkg == c or pkg.startswith(c + "/") for c in copied),
                                "%s needs package %s, which no COPY brings" % (comp, pkg))
            # install_deps.sh runs before the build.
            runs = [a for w, a in build if w == "RUN"]
            self.assertIn("tools/install_deps.sh", runs[0], comp)

    def test_builds_and_runs_the_real_binary_with_real_flags(self):
        for comp, d in self.files.items():
            binary = du.BINARIES[comp]
            pkg, name = os.path.dirname(binary), os.path.basename(binary)
            build = " ".join(a for w, a in d.stages[0][2] if w == "RUN")
            self.assertRegex(build, r"bazel build -c opt //%s:%s(\s|$)" % (pkg, name), comp)
            self.assertIn("deploy/docker/bundle.sh bazel-bin/%s /out" % binary, build, comp)
            final = d.final()[2]
            self.assertIn(("COPY", "--from=build /out/ /opt/specserve/"), final, comp)
            env = [a for w, a in final if w == "ENV" and a.startswith("LD_LIBRARY_PATH=")]
            self.assertTrue(env and env[0].split("=", 1)[1].split(":")[0] == "/opt/specserve/lib")
            entry = exec_form([a for w, a in final if w == "ENTRYPOINT"][0])
            self.assertEqual(entry, ["/opt/specserve/bin/" + name], comp)
            cmd = exec_form([a for w, a in final if w == "CMD"][0])
            self.assertEqual(du.check_with_binary(comp, cmd), [], (comp, cmd))
            # EXPOSE = the ports CMD sets = the k8s base flagfile's ports.
            flags = du.flag_map(cmd)
            expose = sorted(int(p) for w, a in final if w == "EXPOSE" for p in a.split())
            ports = ("port", "metrics_port", "http_port")
            self.assertEqual(expose, sorted(int(flags[k]) for k in ports if k in flags), comp)
            with open("deploy/k8s/base/flags/%s.flags" % comp) as f:
                base = du.flag_map(du.parse_flagfile(f.read()))
            self.assertEqual("http_port" in flags, "http_port" in base, comp)
            for k in [p for p in ports if p in flags]:
                self.assertEqual(flags[k], base[k], (comp, k))

    def test_bundle_makes_a_self_contained_lib_dir(self):
        for comp, binary in du.BINARIES.items():
            if not os.path.isfile(binary):
                self.fail("binary %s is missing from the runfiles" % binary)
            out = du.tmpdir()
            subprocess.run(["bash", "deploy/docker/bundle.sh", binary, out], check=True)
            name = os.path.basename(binary)
            env = dict(os.environ, LD_LIBRARY_PATH=os.path.join(out, "lib"))
            ldd = subprocess.run(["ldd", os.path.join(out, "bin", name)], env=env,
                                 capture_output=True, text=True, check=True).stdout
            for line in ldd.splitlines():
                parts = line.split()
                if "=>" not in parts or SYSTEM_LIBS.match(parts[0]):
                    continue
                self.assertTrue(parts[2].startswith(os.path.join(out, "lib") + "/"),
                                "%s: %s not bundled" % (comp, line.strip()))
            self.assertTrue(os.path.isfile(os.path.join(out, "lib", "libsentencepiece.so.0")))
            p = subprocess.run([os.path.join(out, "bin", name), "--helpfull"], env=env,
                               capture_output=True, text=True, timeout=60)
            self.assertIn("Flags from", p.stdout + p.stderr, comp)

    def test_bundle_survives_a_long_ldconfig_cache(self):
        # Regression: `ldconfig -p | awk '... exit'` under pipefail exited 141
        # (SIGPIPE) on machines with many libraries. A fake ldconfig prints
        # the real cache after 200,000 filler lines.
        comp, binary = next(iter(du.BINARIES.items()))
        fake = du.tmpdir()
        real = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True,
                              check=True).stdout
        with open(os.path.join(fake, "filler.txt"), "w") as f:
            f.write("".join("\tlibfiller%d.so (libc6,x86-64) => /nonexistent/libfiller%d.so\n"
                            % (i, i) for i in range(200000)))
        with open(os.path.join(fake, "real.txt"), "w") as f:
            f.write(real)
        with open(os.path.join(fake, "ldconfig"), "w") as f:
            f.write("#!/bin/sh\ncat %s/real.txt %s/filler.txt\n" % (fake, fake))
        os.chmod(os.path.join(fake, "ldconfig"), 0o755)
        env = dict(os.environ, PATH=fake + os.pathsep + os.environ["PATH"])
        out = du.tmpdir()
        p = subprocess.run(["bash", "deploy/docker/bundle.sh", binary, out], env=env,
                           capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertTrue(os.path.isfile(os.path.join(out, "lib", "libsentencepiece.so.0")))


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        if "=" in arg and not arg.startswith("-"):
            comp, path = arg.split("=", 1)
            DEPS[comp] = path
    sys.argv = [sys.argv[0]] + [a for a in sys.argv[1:] if "=" not in a or a.startswith("-")]
    unittest.main()

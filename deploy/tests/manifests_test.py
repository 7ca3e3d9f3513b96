"""Structural test of the rendered Kubernetes manifests (every overlay):
probes, resources, security, flags checked by the real binaries, ports and
Service names that agree with those flags, node pools, NetworkPolicy, PDBs,
HPA, and the Prometheus kubernetes_sd job that must find the pods.
"""

import os
import unittest

import yaml

import deploy_util as du

NAMESPACE = "specserve"
MODEL_SERVICES = ("speculator", "target")


def by_kind(docs, kind):
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def selects(selector, labels):
    """Kubernetes label-selector semantics (matchLabels + matchExpressions)."""
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        op, key, vals = e["operator"], e["key"], e.get("values", [])
        if op == "In" and labels.get(key) not in vals:
            return False
        if op == "NotIn" and labels.get(key) in vals:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def port_number(container, port):
    """A numeric port, or a named containerPort resolved to its number."""
    if isinstance(port, int):
        return port
    for p in container.get("ports", []):
        if p.get("name") == port:
            return p["containerPort"]
    return None


class Rendered:
    """One overlay's output with each Deployment's effective flags."""

    def __init__(self, overlay):
        self.overlay = overlay
        self.docs = du.render(overlay)
        self.deployments = by_kind(self.docs, "Deployment")
        self.services = by_kind(self.docs, "Service")
        self.config_maps = by_kind(self.docs, "ConfigMap")

    def component(self, dep):
        return dep["spec"]["template"]["metadata"]["labels"][
            "app.kubernetes.io/component"]

    def deployment(self, component):
        return [d for d in self.deployments.values()
                if self.component(d) == component][0]

    def container_args(self, dep):
        """(container, args with each --flagfile expanded to a temp file,
        effective flag map)."""
        pod = dep["spec"]["template"]["spec"]
        c = pod["containers"][0]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        args, flags_text = [], []
        for a in c.get("args", []):
            if not a.startswith("--flagfile="):
                args.append(a)
                continue
            path = a.split("=", 1)[1]
            mount = [m for m in c.get("volumeMounts", [])
                     if path.startswith(m["mountPath"].rstrip("/") + "/")]
            assert mount, "%s: no volume mounted for %s" % (c["name"], path)
            cm_name = volumes[mount[0]["name"]]["configMap"]["name"]
            key = os.path.relpath(path, mount[0]["mountPath"])
            text = self.config_maps[cm_name]["data"][key]
            local = os.path.join(du.tmpdir(), key)
            with open(local, "w") as f:
                f.write(text)
            args.append("--flagfile=" + local)
            flags_text += du.parse_flagfile(text)
        plain = [a for a in args if not a.startswith("--flagfile=")]
        return c, args, du.flag_map(flags_text + plain)


class ManifestsTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.rendered = [Rendered(o) for o in du.OVERLAYS]

    def test_every_kind_is_there_in_one_namespace(self):
        for r in self.rendered:
            kinds = sorted(d["kind"] for d in r.docs)
            for kind, n in [("Deployment", 3), ("Service", 3),
                            ("PodDisruptionBudget", 3), ("ConfigMap", 1),
                            ("HorizontalPodAutoscaler", 1), ("NetworkPolicy", 1),
                            ("PersistentVolumeClaim", 1), ("Namespace", 1)]:
                self.assertEqual(kinds.count(kind), n, (r.overlay, kind))
            for d in r.docs:
                if d["kind"] != "Namespace":
                    self.assertEqual(d["metadata"].get("namespace"), NAMESPACE,
                                     (r.overlay, d["kind"], d["metadata"]["name"]))

    def test_deployments_have_probes_resources_and_security(self):
        for r in self.rendered:
            for name, dep in r.deployments.items():
                where = (r.overlay, name)
                pod = dep["spec"]["template"]["spec"]
                self.assertTrue(selects(dep["spec"]["selector"],
                                        dep["spec"]["template"]["metadata"]["labels"]), where)
                self.assertIs(pod.get("automountServiceAccountToken"), False, where)
                psc = pod["securityContext"]
                self.assertIs(psc.get("runAsNonRoot"), True, where)
                self.assertNotEqual(psc.get("runAsUser", 0), 0, where)
                self.assertEqual(psc["seccompProfile"]["type"], "RuntimeDefault", where)
                self.assertEqual(len(pod["containers"]), 1, where)
                c = pod["containers"][0]
                sc = c["securityContext"]
                self.assertIs(sc.get("allowPrivilegeEscalation"), False, where)
                self.assertIs(sc.get("readOnlyRootFilesystem"), True, where)
                self.assertIs(sc.get("runAsNonRoot"), True, where)
                self.assertEqual(sc["capabilities"]["drop"], ["ALL"], where)
                # gRPC health probes, or (TLS: kubelet's gRPC probes are
                # plaintext only) HTTP probes of /metrics.
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    self.assertTrue({"grpc", "httpGet"} & set(c.get(probe, {})),
                                    where + (probe,))
                startup = c["startupProbe"]
                budget = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
                if r.component(dep) in MODEL_SERVICES:
                    self.assertGreaterEqual(budget, 300, where)  # model loading
                res = c["resources"]
                self.assertIn("cpu", res["requests"], where)
                self.assertIn("memory", res["requests"], where)
                self.assertIn("memory", res["limits"], where)
                # Weights come from the read-only models volume, never the image.
                models = [m for m in c["volumeMounts"] if m["mountPath"] == "/models"]
                self.assertEqual(len(models), 1, where)
                self.assertIs(models[0].get("readOnly"), True, where)

    def test_images_match_the_dockerfiles(self):
        for r in self.rendered:
            for dep in r.deployments.values():
                comp = r.component(dep)
                image = dep["spec"]["template"]["spec"]["containers"][0]["image"]
                repo, _, tag = image.rpartition(":")
                self.assertTrue(repo.endswith("specserve/" + comp), image)
                self.assertTrue(tag and "/" not in tag, image)
                self.assertTrue(os.path.isfile("deploy/docker/%s.Dockerfile" % comp), comp)

    def test_flags_are_accepted_by_the_real_binaries(self):
        for r in self.rendered:
            for dep in r.deployments.values():
                comp = r.component(dep)
                _, args, flags = r.container_args(dep)
                self.assertTrue(flags, (r.overlay, comp))
                self.assertEqual(du.check_with_binary(comp, args), [], (r.overlay, comp, args))

    def test_ports_probes_services_and_annotations_agree_with_flags(self):
        for r in self.rendered:
            for dep in r.deployments.values():
                comp = r.component(dep)
                where = (r.overlay, comp)
                c, _, flags = r.container_args(dep)
                grpc, metrics = int(flags["port"]), int(flags["metrics_port"])
                self.assertEqual(port_number(c, "grpc"), grpc, where)
                self.assertEqual(port_number(c, "metrics"), metrics, where)
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    if "tls_cert_file" in flags:
                        self.assertNotIn("grpc", c[probe], where + (probe,))
                        get = c[probe]["httpGet"]
                        self.assertEqual(port_number(c, get["port"]), metrics,
                                         where + (probe,))
                        self.assertEqual(get["path"], "/metrics", where + (probe,))
                    else:
                        self.assertEqual(c[probe]["grpc"]["port"], grpc, where + (probe,))
                ann = dep["spec"]["template"]["metadata"]["annotations"]
                self.assertEqual(ann["prometheus.io/scrape"], "true", where)
                self.assertEqual(int(ann["prometheus.io/port"]), metrics, where)
                if "host" in flags:
                    self.assertIn(flags["host"], ("0.0.0.0", "[::]", "::"), where)
                svc = self.service_for(r, dep)
                ports = {p["name"]: p for p in svc["spec"]["ports"]}
                self.assertEqual(port_number(c, ports["grpc"]["targetPort"]), grpc, where)
                self.assertEqual(port_number(c, ports["metrics"]["targetPort"]), metrics, where)
                if comp in MODEL_SERVICES:
                    self.assertEqual(svc["spec"].get("clusterIP"), "None", where)
                    self.assertTrue(flags["model"].startswith("/models/"), where)

    def test_tls_files_come_from_secrets(self):
        """Every --*tls*_file flag names a file in a mounted Secret; with TLS
        the model services require router client certificates and the
        router presents one, verifying them under one server name."""
        file_flags = ("tls_cert_file", "tls_key_file", "tls_client_ca_file",
                      "backend_tls_ca_file", "backend_tls_cert_file",
                      "backend_tls_key_file")
        with_tls = set()
        for r in self.rendered:
            for dep in r.deployments.values():
                comp = r.component(dep)
                where = (r.overlay, comp)
                c, _, flags = r.container_args(dep)
                volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
                for flag in file_flags:
                    if not flags.get(flag):
                        continue
                    path = flags[flag]
                    mounts = [m for m in c["volumeMounts"]
                              if path.startswith(m["mountPath"].rstrip("/") + "/")]
                    self.assertEqual(len(mounts), 1, where + (flag, path))
                    self.assertIs(mounts[0].get("readOnly"), True, where + (flag,))
                    secret = volumes[mounts[0]["name"]].get("secret")
                    self.assertTrue(secret, where + (flag, "not from a Secret"))
                    self.assertEqual(secret["secretName"], "specserve-%s-tls" % comp, where)
                if not flags.get("tls_cert_file"):
                    continue
                with_tls.add(r.overlay)
                self.assertTrue(flags.get("tls_key_file"), where)
                if comp in MODEL_SERVICES:
                    self.assertTrue(flags.get("tls_client_ca_file"), where)
                    self.assertNotEqual(flags.get("tls_require_client_cert"), "false", where)
                else:
                    for flag in ("backend_tls_ca_file", "backend_tls_cert_file",
                                 "backend_tls_key_file", "backend_tls_server_name"):
                        self.assertTrue(flags.get(flag), where + (flag,))
        self.assertIn("local-cpu-tls", with_tls)
        # Plaintext stays the default.
        self.assertNotIn("local-cpu", with_tls)
        self.assertNotIn("gpu", with_tls)

    def service_for(self, r, dep):
        labels = dep["spec"]["template"]["metadata"]["labels"]
        svcs = [s for s in r.services.values() if selects(
            {"matchLabels": s["spec"]["selector"]}, labels)]
        self.assertEqual(len(svcs), 1, (r.overlay, dep["metadata"]["name"]))
        return svcs[0]

    def test_router_resolves_the_headless_services_with_dns(self):
        for r in self.rendered:
            _, _, flags = r.container_args(r.deployment("router"))
            for comp in MODEL_SERVICES:
                dep = r.deployment(comp)
                svc = self.service_for(r, dep)
                grpc = [p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc"][0]
                want = "dns:///%s:%d" % (svc["metadata"]["name"], grpc)
                self.assertEqual(flags[comp], want, r.overlay)
            # Same tokenizer as the target (the router checks fingerprints).
            _, _, target = r.container_args(r.deployment("target"))
            self.assertEqual(flags["tokenizer"], target["model"], r.overlay)

    def test_model_services_on_separate_gpu_pools(self):
        for r in self.rendered:
            pools = {}
            for comp in ("router",) + MODEL_SERVICES:
                pod = r.deployment(comp)["spec"]["template"]["spec"]
                res = pod["containers"][0]["resources"]
                gpus = int(res.get("limits", {}).get("nvidia.com/gpu", 0))
                if r.overlay != "gpu" or comp == "router":
                    self.assertEqual(gpus, 0, (r.overlay, comp))
                    continue
                self.assertGreaterEqual(gpus, 1, comp)
                tolerations = pod.get("tolerations", [])
                self.assertTrue(any(t["key"] == "nvidia.com/gpu" for t in tolerations), comp)
                terms = pod["affinity"]["nodeAffinity"][
                    "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
                exprs = [e for t in terms for e in t["matchExpressions"]
                         if e["key"] == "specserve.io/pool" and e["operator"] == "In"]
                self.assertEqual(len(exprs), 1, comp)
                pools[comp] = set(exprs[0]["values"])
            if r.overlay == "gpu":
                self.assertFalse(pools["speculator"] & pools["target"], pools)

    def test_only_the_router_reaches_the_model_services(self):
        for r in self.rendered:
            router_labels = r.deployment("router")["spec"]["template"]["metadata"]["labels"]
            for comp in MODEL_SERVICES:
                dep = r.deployment(comp)
                c, _, flags = r.container_args(dep)
                labels = dep["spec"]["template"]["metadata"]["labels"]
                policies = [p for p in by_kind(r.docs, "NetworkPolicy").values()
                            if selects(p["spec"]["podSelector"], labels)
                            and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
                self.assertTrue(policies, (r.overlay, comp))
                grpc_rules = 0
                for p in policies:
                    for rule in p["spec"].get("ingress", []):
                        ports = [port_number(c, x.get("port")) for x in rule.get("ports", [])]
                        if rule.get("ports") and int(flags["port"]) not in ports:
                            continue  # e.g. the metrics port for Prometheus
                        grpc_rules += 1
                        peers = rule.get("from")
                        self.assertTrue(peers, "%s: gRPC open to all" % comp)
                        for peer in peers:
                            self.assertEqual(set(peer), {"podSelector"}, (comp, peer))
                            self.assertTrue(selects(peer["podSelector"], router_labels))
                            self.assertFalse(selects(peer["podSelector"], labels), comp)
                self.assertGreater(grpc_rules, 0, comp)

    def test_disruption_budgets_and_autoscaler(self):
        for r in self.rendered:
            pdbs = by_kind(r.docs, "PodDisruptionBudget").values()
            for name, dep in r.deployments.items():
                labels = dep["spec"]["template"]["metadata"]["labels"]
                self.assertEqual(sum(selects(p["spec"]["selector"], labels) for p in pdbs), 1, name)
            hpa = list(by_kind(r.docs, "HorizontalPodAutoscaler").values())[0]["spec"]
            ref = hpa["scaleTargetRef"]
            self.assertEqual((ref["kind"], ref["name"]),
                             ("Deployment", r.deployment("router")["metadata"]["name"]))
            self.assertLessEqual(1, hpa["minReplicas"])
            self.assertLessEqual(hpa["minReplicas"], hpa["maxReplicas"])

    def test_prometheus_kubernetes_sd_finds_the_pods(self):
        with open("deploy/prometheus/prometheus.yml") as f:
            config = yaml.safe_load(f)
        jobs = [j for j in config["scrape_configs"] if j.get("kubernetes_sd_configs")]
        self.assertEqual(len(jobs), 1)
        sd = jobs[0]["kubernetes_sd_configs"][0]
        self.assertEqual(sd["role"], "pod")
        self.assertIn(NAMESPACE, sd["namespaces"]["names"])
        keep = [rc for rc in jobs[0]["relabel_configs"] if rc.get("action") == "keep"
                and rc["source_labels"] ==
                ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"]]
        self.assertEqual(len(keep), 1)
        self.assertTrue(any(rc.get("target_label") == "component" and rc["source_labels"] == [
            "__meta_kubernetes_pod_label_app_kubernetes_io_component"]
            for rc in jobs[0]["relabel_configs"]))


if __name__ == "__main__":
    unittest.main()

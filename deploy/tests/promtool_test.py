"""promtool (Debian's prometheus package) over deploy/prometheus: the two
scrape configs, the rule files, the rule unit tests, and every PromQL
expression of the Grafana dashboard (compiled as recording rules).
"""

import json
import os
import re
import shutil
import subprocess
import unittest

import yaml

import deploy_util as du

RULES = ("recording_rules.yml", "alert_rules.yml")
RECORDED = re.compile(r"\bspecserve:[a-z0-9_]+:[a-z0-9_]+\b")


def promtool(*args, cwd):
    return subprocess.run(["promtool"] + list(args), cwd=cwd, capture_output=True, text=True)


class PromtoolTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.dir = os.path.join(du.tmpdir(), "prometheus")
        shutil.copytree("deploy/prometheus", cls.dir)
        with open(os.path.join(cls.dir, "recording_rules.yml")) as f:
            cls.recorded = {r["record"] for g in yaml.safe_load(f)["groups"] for r in g["rules"]}
        with open("deploy/grafana/specserve-dashboard.json") as f:
            cls.dashboard = json.load(f)

    def check(self, *args):
        p = promtool(*args, cwd=self.dir)
        self.assertEqual(p.returncode, 0, "promtool %s:\n%s%s" % (" ".join(args), p.stdout, p.stderr))
        return p

    def test_local_config(self):
        p = self.check("check", "config", "prometheus-local.yml")
        self.assertIn("2 rule files found", p.stdout + p.stderr)

    def test_cluster_config(self):
        p = promtool("check", "config", "prometheus.yml", cwd=self.dir)
        if p.returncode != 0 and "field kubernetes_sd_configs not found" in p.stderr:
            # Debian builds Prometheus without Kubernetes discovery; check the
            # rest of the file (relabelling, rule files) with the discovery
            # block swapped for a static one. manifests_test checks the
            # kubernetes_sd block against the rendered pods.
            with open(os.path.join(self.dir, "prometheus.yml")) as f:
                config = yaml.safe_load(f)
            swapped = 0
            for job in config["scrape_configs"]:
                if job.pop("kubernetes_sd_configs", None) is not None:
                    job["static_configs"] = [{"targets": ["127.0.0.1:9"]}]
                    swapped += 1
            self.assertEqual(swapped, 1)
            with open(os.path.join(self.dir, "prometheus-static.yml"), "w") as f:
                yaml.safe_dump(config, f)
            print("note: this promtool has no kubernetes_sd; checked the rest of prometheus.yml")
            p = self.check("check", "config", "prometheus-static.yml")
        else:
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("2 rule files found", p.stdout + p.stderr)

    def test_rules(self):
        self.check("check", "rules", *RULES)

    def test_rule_unit_tests(self):
        p = self.check("test", "rules", "tests/rules_test.yml")
        self.assertIn("SUCCESS", p.stdout)

    def test_alerts_use_recorded_series(self):
        with open(os.path.join(self.dir, "alert_rules.yml")) as f:
            alerts = [r for g in yaml.safe_load(f)["groups"] for r in g["rules"]]
        self.assertLessEqual({"SpecserveSpeculatorFallbackRateHigh",
                              "SpecserveAcceptanceRateCollapsed",
                              "SpecserveTTFTP95OverTarget"}, {a["alert"] for a in alerts})
        for a in alerts:
            self.assertLessEqual(set(RECORDED.findall(a["expr"])), self.recorded, a["alert"])

    def test_dashboard(self):
        panels = self.dashboard["panels"]
        self.assertEqual(len({p["id"] for p in panels}), len(panels))
        exprs = [t["expr"] for p in panels for t in p["targets"]]
        for p in panels:
            self.assertEqual(p["datasource"]["uid"], "${datasource}", p["title"])
            self.assertTrue(p["targets"], p["title"])
        used = set(RECORDED.findall(" ".join(exprs)))
        self.assertLessEqual(used, self.recorded)
        for series in ("specserve:spec_decode_acceptance_rate:ratio_rate5m",
                       "specserve:spec_decode_mean_acceptance_length:rate5m",
                       "specserve:keep_ratio:ratio_rate5m", "specserve:ttft_seconds:p50_5m",
                       "specserve:ttft_seconds:p95_5m", "specserve:fallback_rate:ratio_rate5m"):
            self.assertIn(series, used)
        # Every expression must compile: promtool parses them as rules.
        rules = {"groups": [{"name": "dashboard", "rules": [
            {"record": "dashboard:expr_%d:x" % i,
             "expr": e.replace("$__rate_interval", "1m")} for i, e in enumerate(exprs)]}]}
        with open(os.path.join(self.dir, "dashboard_rules.yml"), "w") as f:
            yaml.safe_dump(rules, f)
        self.check("check", "rules", "dashboard_rules.yml")


if __name__ == "__main__":
    unittest.main()

"""configs/prometheus-rules.yaml, the Prometheus alerting rules on the service's own metrics: valid for promtool, they
fire on recorded series (tests/monitor/data/prometheus_rules_test.yaml: staleness, the service down, a replica's
DRIFT and unreachable verdicts), and every series they read is one the service exposes. Skipped with the reason
where promtool is absent (Debian: apt-get install prometheus; .ci/run installs it)."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from monitor.service.exporter import REPLICA_VERDICTS, ServiceMetrics

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "configs" / "prometheus-rules.yaml"
RULE_TESTS = REPO / "tests" / "monitor" / "data" / "prometheus_rules_test.yaml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="no promtool (Debian: apt-get install prometheus)")


@needs_promtool
def test_promtool_checks_the_rules():
    done = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "SUCCESS: 5 rules found" in done.stdout, done.stdout + done.stderr


@needs_promtool
def test_the_rules_fire_on_recorded_series():
    done = subprocess.run([PROMTOOL, "test", "rules", RULE_TESTS.name], cwd=RULE_TESTS.parent, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr


def test_the_rules_read_series_and_verdicts_the_service_exposes():
    exposed = {metric.name for metric in ServiceMetrics("m").registry.collect()}
    rules = [r for group in yaml.safe_load(RULES.read_text())["groups"] for r in group["rules"]]
    for rule in rules:
        for name in re.findall(r"draftops_monitor_\w+", rule["expr"]):
            assert name in exposed, f"{rule['alert']} reads {name}, which the service does not expose"
        for verdict in re.findall(r'verdict="(\w+)"', rule["expr"]):
            assert verdict in REPLICA_VERDICTS
    assert {"DraftopsMonitorStale", "DraftopsReplicaDrift", "DraftopsReplicaUnreachable"} <= {r["alert"] for r in rules}

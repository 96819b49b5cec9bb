"""The monitor as a team deploys it, on loopback: a fleet of two llama-server replicas, a real Prometheus scraping
them, a real `mlflow server` (sqlite backend, local artifact folder), a real Alertmanager, and `draftops monitor serve`
(the service, in-process) reading the replicas' windows from Prometheus' API. Marked `integration` and `llamacpp`;
skipped with the reason where a binary is absent (`apt-get install prometheus prometheus-alertmanager`, `draftops
llama-cpp build`).

Both replicas serve the real SmolLM2 target with the champion draft (a copy of the target, exported as GGUF, so that
the acceptance is high and falls unmistakably with the target), traffic replayed to both without a pause; Prometheus
scrapes both every second under `replica="a"` and `replica="b"`, and the service's own /metrics. The service's first
check, after 8 windows (15 s each), records the champion's offline baseline and finds each replica's baseline windows;
then replica b alone is restarted on an updated target (LoRA, merged, written as GGUF as the serve demo does), and the
service's check 3 windows later finds b, and not a, DRIFT: its name is in the report, in the alert Alertmanager's API
lists, and in the per-replica series of the service's /metrics, which Prometheus scrapes too."""
from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from decode.serving.export import draft_source, export_format, target_gguf
from decode.serving.llamacpp import find_server, free_port
from monitor.check.decision import Cause, Status
from monitor.fleet.verdicts import fleet_verdict
from monitor.rehearsal.demo_engine import ServedEngine, write_target_gguf
from monitor.rehearsal.serve_demo import replayed_prompts
from monitor.rehearsal.target_update import run_finetune
from monitor.service import scheduler
from pipeline.config import load_config
from pipeline.traffic import DEFAULT_TRAFFIC
from tests.loopback_servers import Alertmanager, Prometheus, TrackingServer, binary
from tests.monitor.rehearsal.test_serve_demo import register_copy

pytestmark = [pytest.mark.integration, pytest.mark.llamacpp]
REPO = Path(__file__).resolve().parents[2]
WINDOW = 15  # seconds: Prometheus scrapes every second, so a window holds 15 samples
BASELINE, RECENT = 8, 3  # 1 / C(11, 3) < 0.05 / 3: each replica's test can alarm beside the fleet's


@pytest.fixture(scope="module")
def binaries():
    prometheus, alertmanager = binary("prometheus"), binary("alertmanager", "prometheus-alertmanager")
    server = find_server()
    if prometheus is None or alertmanager is None:
        pytest.skip("no prometheus or alertmanager binary (Debian: apt-get install prometheus prometheus-alertmanager)")
    if server is None:
        pytest.skip("no llama-server (draftops llama-cpp build, or make test-llamacpp)")
    return prometheus, alertmanager, server.parent, os.environ.get("DRAFTOPS_HOME")


class Traffic:
    """The held-out prompts sent to one replica in a loop, greedy, until stopped."""

    def __init__(self, engine: ServedEngine, prompts: list[list[int]], max_new_tokens: int):
        self.engine, self.prompts, self.max_new_tokens = engine, prompts, max_new_tokens
        self.stop, self.sent, self.errors = threading.Event(), 0, []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.engine.complete(self.prompts[self.sent % len(self.prompts)], self.max_new_tokens)
                self.sent += 1
            except Exception as exc:  # a restart in progress: the next request waits for it
                self.errors.append(repr(exc))
                time.sleep(0.2)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=120)


def until_boundary(windows: int = 1) -> None:
    """Sleep past the `windows`-th window boundary from now (and a second more, for Prometheus' last scrape)."""
    time.sleep((time.time() // WINDOW + windows) * WINDOW - time.time() + 1.5)


class ServiceCheck:
    """`draftops monitor serve --run-now` in a thread (the service's own code: scheduler, /metrics, alerts) until its
    check has ended; the report is caught from the service's after-check hooks, and the service keeps running (its
    /metrics scraped, its alerts sent) until `stop()`."""

    def __init__(self, overrides: list[str]):
        self.reports, self.stop_event = [], threading.Event()
        self.hook = lambda cfg, report, code, seconds: self.reports.append(report)
        scheduler._after_check_hooks.append(self.hook)
        self.thread = threading.Thread(target=scheduler.serve, args=(REPO / "configs" / "serve_demo.yaml",),
                                       kwargs={"run_now": True, "stop_event": self.stop_event,
                                               "overrides": overrides}, daemon=True)
        self.thread.start()

    def report(self, timeout: float = 900):
        deadline = time.monotonic() + timeout
        while not self.reports:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the service's check never ended"
            time.sleep(1)
        assert self.reports[0] is not None, "the service's check crashed (see the log)"
        return self.reports[0]

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=120)
        scheduler._after_check_hooks.remove(self.hook)


def eventually(read, timeout: float = 60):
    """`read()`'s first truthy answer within `timeout` seconds (Prometheus' next scrape, Alertmanager's intake)."""
    deadline = time.monotonic() + timeout
    while not (answer := read()) and time.monotonic() < deadline:
        time.sleep(1)
    return answer


def service_samples(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture
def tracking_and_alerts(tmp_path, binaries):
    """A real tracking server and a real Alertmanager for one test."""
    tracking = TrackingServer(tmp_path / "tracking")
    try:
        alertmanager = Alertmanager(binaries[1], tmp_path / "alertmanager")
    except BaseException:
        tracking.close()
        raise
    yield tracking, alertmanager
    alertmanager.close()
    tracking.close()


def test_the_replica_on_an_updated_target_is_drift_by_name_and_the_other_is_not(tmp_path, binaries,
                                                                               tracking_and_alerts, monkeypatch):
    prometheus_binary, _, llama_binaries, home = binaries
    tracking, alertmanager = tracking_and_alerts
    monkeypatch.setenv("DRAFTOPS_LLAMA_CPP", str(llama_binaries))
    if home:
        monkeypatch.setenv("DRAFTOPS_HOME", home)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking.url)
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    prompts_file = tmp_path / "update_prompts.jsonl"
    with open(DEFAULT_TRAFFIC) as f:
        prompts_file.write_text("".join(line for line, _ in zip(f, range(16))))
    metrics_port = free_port()
    common = [f"tracking.uri={tracking.url}", "monitor.heldout_requests=16", "monitor.n_bootstrap=300",
              "decode.max_new_tokens=32", "distill.max_new_tokens=32", "distill.generation_batch_size=16",
              f"target_update.prompts={prompts_file}", "target_update.max_prompts=16", "target_update.steps=15",
              f"target_update.output_dir={tmp_path / 'target-updated'}", f"monitor.state_dir={tmp_path / 'state'}",
              "monitor.deploy.enabled=false", "monitor.deploy.engine_check=off"]
    cfg = load_config(REPO / "configs" / "serve_demo.yaml", common)
    register_copy(cfg, tmp_path / "v1")  # version 1, the champion, in the tracking server's registry
    draft = next(export_format(draft_source(str(tmp_path / "v1")), "gguf", tmp_path / "draft-gguf",
                               vocabulary=target_gguf(cfg.target)).glob("*.gguf"))
    served = target_gguf(cfg.target)
    updated = write_target_gguf(run_finetune(cfg).path, served, tmp_path / "target-updated.gguf")
    prompts = replayed_prompts(cfg)
    engines = {name: ServedEngine(served, draft=draft, draft_max=cfg.decode.gamma, threads=1,
                                  log_dir=tmp_path / f"engine-{name}") for name in ("a", "b")}
    started, traffic, prometheus, services = [], [], None, []
    try:
        for engine in engines.values():
            started.append(engine.__enter__())
        prometheus = Prometheus(prometheus_binary, {n: f"127.0.0.1:{e.port}" for n, e in engines.items()},
                                tmp_path / "prometheus", jobs={"draftops-monitor": f"127.0.0.1:{metrics_port}"})
        service = [
            *common, f"monitor.prometheus_url={prometheus.url}", f"monitor.prometheus_window={WINDOW}s",
            "monitor.prometheus_replica_label=replica", 'monitor.prometheus_selector=job="llama"',
            f"monitor.engines={json.dumps([{'replica': n, 'url': e.metrics_url} for n, e in engines.items()])}",
            f"monitor.server_baseline_windows={BASELINE}", f"monitor.server_recent_windows={RECENT}",
            f"monitor.metrics_port={metrics_port}", "monitor.schedule=0 3 * * *",
            f"monitor.alerts.targets={json.dumps([{'kind': 'alertmanager', 'url': alertmanager.url}])}"]
        until_boundary()
        traffic = [Traffic(engine, prompts, cfg.decode.max_new_tokens) for engine in engines.values()]
        until_boundary(BASELINE)
        services.append(ServiceCheck(service))
        first = services[-1].report()  # the offline baseline; each replica's baseline windows from Prometheus
        print(first.summary())
        assert first.baseline_recorded and first.server.source == "prometheus"
        assert all(r.n_baseline_windows == BASELINE for r in first.server.replicas), first.summary()
        services.pop().stop()
        engines["b"].restart(target=updated)  # the target update rolled out to replica b alone
        until_boundary(RECENT + 1)
        services.append(ServiceCheck(service))
        report = services[-1].report()
        summary = report.summary()
        print(summary)
        verdict, replicas = fleet_verdict(report.server)
        assert replicas == {"a": "OK", "b": "DRIFT"}, summary
        assert verdict == "DRIFT" and report.decision.status is Status.DRIFT, summary
        assert report.decision.cause is Cause.SERVER_ACCEPTANCE_DROPPED  # the offline check (original target) saw none
        assert "DRIFT on replica b, not on a" in report.decision.reasons, summary
        assert "replica b (llamacpp): DRIFT" in summary and "replica a (llamacpp): OK" in summary
        assert [o.replica for o in report.server.outliers()] == ["b"], summary
        # the alert Alertmanager lists names replica b, and none names a
        drift = eventually(lambda: [a["labels"] for a in alertmanager.alerts()
                                    if a["labels"].get("alertname") == "DraftDrift"])
        assert [a.get("replica") for a in drift] == ["b"], drift
        # the service's /metrics parses and holds the per-replica figures; Prometheus scrapes them too
        model = ("model", cfg.tracking.registered_model)
        got = service_samples(metrics_port)
        assert got[("draftops_monitor_replica_verdict", (model, ("replica", "b"), ("verdict", "DRIFT")))] == 1.0
        assert got[("draftops_monitor_replica_verdict", (model, ("replica", "a"), ("verdict", "OK")))] == 1.0
        assert (got[("draftops_monitor_replica_acceptance", (model, ("replica", "b")))]
                < got[("draftops_monitor_replica_acceptance", (model, ("replica", "a")))])
        assert got[("draftops_monitor_verdict", (model, ("verdict", "DRIFT")))] == 1.0
        assert got[("draftops_monitor_alerts_sent_total", (model, ("target", "alertmanager")))] >= 1.0
        scraped = eventually(lambda: prometheus.query(
            'draftops_monitor_replica_verdict{job="draftops-monitor",verdict="DRIFT"} == 1'))
        assert [r["metric"]["replica"] for r in scraped] == ["b"], scraped
    finally:
        for running in services:
            running.stop()
        for flow in traffic:
            flow.close()
        if prometheus is not None:
            prometheus.close()
        for engine in started:
            engine.__exit__(None, None, None)

"""Alerts as Alertmanager's clients send them, across a restart of the service: an active alert is sent again at each
check with an `endsAt` past the next expected check and the same `startsAt`, an ERROR keeps it firing, and a check
that no longer finds it sends the resolve (Alertmanager, and a webhook's `resolved` message). /metrics after a restart
shows the last check's figures and their time; a taken metrics port stops the service with exit 2."""
import socket
import threading
import time
import urllib.request
from datetime import datetime, timezone

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from monitor.check.decision import EXIT_ERROR
from monitor.service import alert_book
from monitor.service.scheduler import MonitorService, run_scheduled_check, serve
from tests.monitor.service.fake_endpoints import Receiver, free_port

FAKES = "tests.monitor.service.fake_endpoints"


@pytest.fixture
def receivers():
    made = [Receiver(), Receiver()]
    yield made
    for r in made:
        r.close()


def write_config(tmp_path, receivers=(), port=None) -> str:
    path = tmp_path / "monitor.yaml"
    targets = [{"kind": kind, "url": r.url} for kind, r in zip(("alertmanager", "webhook"), receivers)]
    path.write_text(yaml.safe_dump({
        "tracking": {"uri": f"sqlite:///{tmp_path}/mlflow.db", "system_metrics": False},
        "monitor": {"state_dir": str(tmp_path / "state"), "metrics_port": port or free_port(),
                    "alerts": {"targets": targets, "deadline": 5.0}}}))
    return str(path)


def when(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def check_and_collect(path: str, check: str, receiver: Receiver, count: int) -> list[dict]:
    """Run one check through the service's job and wait for the `count` POSTs it makes to `receiver`."""
    before = len(receiver.requests)
    run_scheduled_check(path, f"{FAKES}:{check}")
    deadline = time.monotonic() + 10
    while len(receiver.requests) < before + count and time.monotonic() < deadline:
        time.sleep(0.05)
    return [r["body"] for r in receiver.requests[before:]]


def test_an_active_alert_is_sent_again_each_check_and_resolved_once_cleared_across_a_restart(tmp_path, receivers):
    am, hook = receivers
    path = write_config(tmp_path, receivers)
    service = MonitorService(path)
    service.start()
    try:
        (first,) = check_and_collect(path, "drift_check", am, 1)
        (drift,) = first
        next_check = service.next_run_time()
        assert drift["labels"]["alertname"] == "DraftDrift" and when(drift["endsAt"]) > next_check
        (again,) = check_and_collect(path, "drift_check", am, 1)
        assert again[0]["startsAt"] == drift["startsAt"] and when(again[0]["endsAt"]) > next_check
    finally:
        service.stop()
    assert [a.name for a in alert_book.active(service.cfg)] == ["DraftDrift"]  # on disk, whole

    restarted = MonitorService(path)
    restarted.start()
    try:
        # an ERROR cannot tell whether the drift is over: it stays firing beside the error
        (batch,) = check_and_collect(path, "error_check", am, 1)
        firing = {a["labels"]["alertname"]: a for a in batch}
        assert set(firing) == {"DraftDrift", "MonitorCheckError"}
        assert firing["DraftDrift"]["startsAt"] == drift["startsAt"]  # the same alert, not a new one
        assert all(when(a["endsAt"]) > datetime.now(timezone.utc) for a in batch)
        # the next check finds nothing: both resolved, endsAt now
        (resolved,) = check_and_collect(path, "ok_check", am, 1)
        assert {a["labels"]["alertname"] for a in resolved} == {"DraftDrift", "MonitorCheckError"}
        assert all(when(a["endsAt"]) <= datetime.now(timezone.utc) for a in resolved)
        assert alert_book.active(restarted.cfg) == []
        assert check_and_collect(path, "ok_check", am, 0) == []  # nothing active, nothing sent
    finally:
        restarted.stop()
    statuses = [(b["status"], sorted(a["name"] for a in b["alerts"])) for b in (r["body"] for r in hook.requests)]
    assert statuses[-1] == ("resolved", ["DraftDrift", "MonitorCheckError"])
    assert all(a["status"] == "resolved" and a["ends_at"] for a in hook.requests[-1]["body"]["alerts"])


def scrape(port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_after_a_restart_show_the_last_verdict_and_its_time(tmp_path):
    port = free_port()
    path = write_config(tmp_path, port=port)
    service = MonitorService(path)
    service.start()
    try:
        run_scheduled_check(path, f"{FAKES}:drift_check")
        before = scrape(port)
    finally:
        service.stop()
    restarted = MonitorService(path)
    restarted.start()
    try:
        after = scrape(port)
    finally:
        restarted.stop()
    model = (("model", "draftops-draft"),)
    ended = before[("draftops_monitor_last_check_timestamp_seconds", model)]
    assert after[("draftops_monitor_last_check_timestamp_seconds", model)] == ended
    assert after[("draftops_monitor_verdict", (("model", "draftops-draft"), ("verdict", "DRIFT")))] == 1.0
    assert after[("draftops_monitor_acceptance", model)] == 0.52
    assert after[("draftops_monitor_last_success_timestamp_seconds", model)] == pytest.approx(ended, abs=2)
    assert not any(name == "draftops_monitor_checks_total" for name, _ in after)  # no check ran since the start


def test_a_taken_metrics_port_stops_the_service_with_exit_2(tmp_path, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        path = write_config(tmp_path, port=taken.getsockname()[1])
        stop = threading.Event()
        stop.set()
        assert serve(path, stop_event=stop) == EXIT_ERROR == 2
    assert "cannot serve /metrics on 127.0.0.1" in capsys.readouterr().err

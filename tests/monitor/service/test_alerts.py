import time
from datetime import datetime
from types import SimpleNamespace

import pytest
import yaml

from monitor.check.decision import EXIT_DRIFT, Decision, Status
from monitor.check.outcome import RetrainOutcome
from monitor.fleet.verdicts import DRIFT, OK, FleetReading, ReplicaReading
from monitor.service import alerts
from monitor.service.scheduler import MonitorService, run_scheduled_check
from pipeline.config import ConfigError, load_config
from pipeline.config.alerts import AlertsConfig, AlertTarget
from tests.monitor.service.fake_endpoints import Receiver, closed_port_url, drift_report, free_port


@pytest.fixture
def receiver():
    made = []

    def make(**kwargs):
        made.append(Receiver(**kwargs))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _config(*targets, tries=3, deadline=10.0) -> AlertsConfig:
    return AlertsConfig(targets=[AlertTarget(**t) for t in targets], tries=tries, deadline=deadline)


def test_alertmanager_gets_the_v2_shape_with_the_token_from_the_environment(receiver, monkeypatch):
    am = receiver()
    monkeypatch.setenv("AM_TOKEN", "s3cret")
    results = []
    sent = alerts.send(_config({"kind": "alertmanager", "url": am.url + "/", "secret_env": "AM_TOKEN"}),
                       alerts.report_alerts(drift_report()), lambda kind, ok: results.append((kind, ok)))
    assert sent == 1 and results == [("alertmanager", True)]
    (request,) = am.requests
    assert request["path"] == "/api/v2/alerts"
    assert request["headers"]["Authorization"] == "Bearer s3cret"
    (alert,) = request["body"]
    assert set(alert) <= {"labels", "annotations", "startsAt", "endsAt", "generatorURL"}
    assert alert["labels"] == {"alertname": "DraftDrift", "severity": "warning", "model": "draftops-draft",
                               "version": "3"}
    assert alert["annotations"]["summary"].startswith("DRIFT (traffic_shifted): draftops-draft@champion")
    assert "acceptance dropped" in alert["annotations"]["description"]
    assert datetime.fromisoformat(alert["startsAt"].replace("Z", "+00:00")).tzinfo is not None


def test_webhook_and_slack_bodies_and_a_secret_in_the_url(receiver, monkeypatch):
    hook, slack = receiver(), receiver()
    monkeypatch.setenv("SLACK_PATH", "T000/B000/XXXX")
    batch = [alerts.rollback_alert("draftops-draft", "2")]
    assert alerts.send(_config({"kind": "webhook", "url": hook.url + "/hook"},
                               {"kind": "slack", "url": slack.url + "/services/{secret}", "secret_env": "SLACK_PATH"}),
                       batch) == 2
    body = hook.requests[0]["body"]
    assert body["alerts"][0]["name"] == "ChampionRolledBack" and body["alerts"][0]["labels"]["version"] == "2"
    assert slack.requests[0]["path"] == "/services/T000/B000/XXXX"
    assert "Authorization" not in slack.requests[0]["headers"]
    assert slack.requests[0]["body"] == {"text": "[warning] draftops-draft: champion rolled back to version 2"}


def test_an_ok_check_alerts_nobody_a_promotion_does():
    ok = drift_report(decision=Decision(Status.OK, None))
    assert alerts.report_alerts(ok) == []
    gate = SimpleNamespace(drop=0.05, p_value=0.01)
    ok.retrain = RetrainOutcome("4", gate, promoted=True, previous_champion="3")
    (promoted,) = alerts.report_alerts(ok)
    assert (promoted.name, promoted.severity, promoted.labels) == ("ChallengerPromoted", "info", {"version": "4"})


def test_a_fleet_drift_alerts_once_per_drifting_replica_by_name():
    fleet = FleetReading("prometheus", [ReplicaReading("a", None, "llamacpp", OK),
                                        ReplicaReading("b", None, "llamacpp", DRIFT),
                                        ReplicaReading("c", None, "llamacpp", DRIFT)])
    found = alerts.report_alerts(drift_report(server=fleet))
    assert [(a.name, a.labels.get("replica")) for a in found] == [("DraftDrift", "b"), ("DraftDrift", "c")]
    assert found[0].summary.endswith("on replica b")
    pooled_only = FleetReading("prometheus", [ReplicaReading("a", None, "llamacpp", OK)])
    (alert,) = alerts.report_alerts(drift_report(server=pooled_only))
    assert "replica" not in alert.labels


@pytest.mark.parametrize("kind", ["down", "500", "slow"])
def test_a_failing_target_is_tried_within_the_deadline_and_counted(receiver, kind):
    url = {"down": closed_port_url, "500": lambda: receiver(status=500).url,
           "slow": lambda: receiver(delay=5.0).url}[kind]()
    results = []
    started = time.monotonic()
    sent = alerts.send(_config({"kind": "webhook", "url": url}, deadline=1.5),
                       alerts.report_alerts(drift_report()), lambda k, ok: results.append(ok))
    assert time.monotonic() - started < 3.0
    assert sent == 0 and results == [False]


def test_stale_watch_alerts_once_per_spell(tmp_path):
    watch = alerts.StaleWatch(tmp_path, "m", stale_after_hours=1.0)
    now = time.time()
    watch.succeeded(now - 7200)
    assert watch.due(now).name == "MonitorStale"
    assert watch.due(now + 60) is None  # already told
    watch.succeeded(now)
    assert watch.due(now + 60) is None
    assert watch.due(now + 3700) is not None


def test_a_secret_in_the_config_is_refused():
    with pytest.raises(ConfigError, match="not an environment variable name"):
        load_config(None, ['monitor.alerts.targets=[{"kind": "slack", "url": "https://x", "secret_env": "xoxb-1/2"}]'])


def test_the_service_returns_the_verdict_in_time_while_a_slow_alert_fails_in_the_background(tmp_path, receiver):
    slow = receiver(delay=5.0)
    path = tmp_path / "monitor.yaml"
    path.write_text(yaml.safe_dump({
        "tracking": {"uri": f"sqlite:///{tmp_path}/mlflow.db", "system_metrics": False},
        "monitor": {"state_dir": str(tmp_path / "state"), "metrics_port": free_port(),
                    "alerts": {"targets": [{"kind": "webhook", "url": slow.url}], "deadline": 1.0}}}))
    service = MonitorService(path)
    service.start()
    try:
        started = time.monotonic()
        code = run_scheduled_check(str(path), "tests.monitor.service.fake_endpoints:drift_check")
        assert code == EXIT_DRIFT and time.monotonic() - started < 1.0  # the alert did not hold the check
        failed = service.metrics.alerts_failed.labels("draftops-draft", "webhook")
        deadline = time.monotonic() + 5.0
        while failed._value.get() < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert failed._value.get() == 1
        assert slow.requests and slow.requests[0]["body"]["alerts"][0]["name"] == "DraftDrift"
    finally:
        service.stop()

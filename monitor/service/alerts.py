"""Alerts from the monitor: what a check's report, a promotion, a rollback or a silent service is worth telling someone,
and its delivery to Alertmanager (API v2), a generic webhook or Slack (`monitor.alerts`).

Delivery never touches the check: alerts are built from a finished report and sent after the model lock is released,
in a background thread (`dispatch`), each target with a few tries under one deadline. A failed delivery is logged and
counted (`on_result`), never raised. Secrets stay in the environment: a target names the variable (`secret_env`).
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from monitor.check.decision import Status
from monitor.check.outcome import CheckReport
from monitor.fleet.verdicts import DRIFT, fleet_verdict
from pipeline.config import DraftopsConfig
from pipeline.config.alerts import AlertsConfig, AlertTarget
from pipeline.deadline_http import exchange
from pipeline.url_credentials import redact

log = logging.getLogger("draftops.monitor.alerts")

SEVERITY = {Status.DRIFT: "warning", Status.ERROR: "critical", Status.DEPLOY_MISMATCH: "critical",
            Status.DEPLOY_FAILED: "critical"}
ALERT_NAMES = {Status.DRIFT: "DraftDrift", Status.ERROR: "MonitorCheckError",
               Status.DEPLOY_MISMATCH: "DeployMismatch", Status.DEPLOY_FAILED: "DeployFailed"}
STALE = "MonitorStale"
REQUEST_TIMEOUT = 5.0  # seconds one attempt may take, at most (the target's deadline bounds it further)
MAX_ANSWER_BYTES = 1 << 20  # a receiver answers a status and a few lines
LAST_SUCCESS_FILE = "last_success.json"

OnResult = Callable[[str, bool], None]  # (target kind, delivered)


@dataclass(frozen=True)
class Alert:
    name: str  # Alertmanager's alertname
    severity: str  # critical, warning, info
    model: str
    summary: str
    description: str = ""
    labels: dict[str, str] = field(default_factory=dict)  # more identifying labels (replica, version, ...)
    starts_at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    ends_at: datetime | None = None  # when Alertmanager may resolve it unless sent again (monitor.service.alert_book)
    resolved: bool = False  # its condition cleared: ends_at is when

    def all_labels(self) -> dict[str, str]:
        return {"alertname": self.name, "severity": self.severity, "model": self.model, **self.labels}


def report_alerts(report: CheckReport) -> list[Alert]:
    """The alerts a finished check is worth: its verdict unless OK, a promotion, each rollback it ran."""
    out = []
    model = report.registered_model
    status = report.decision.status
    for replica in report.server.down if report.server is not None else []:
        n = next(r.down_checks for r in report.server.replicas if r.name == replica)
        error = next(r.error for r in report.server.replicas if r.name == replica)
        out.append(Alert("DraftReplicaDown", "critical", model, f"{model}: replica {replica} unreachable at {n} "
                         "checks in a row", error or "", {"replica": replica}))
    if status in ALERT_NAMES:
        cause = f" ({report.decision.cause.value})" if report.decision.cause else ""
        summary = f"{status.value}{cause}: {model}@champion = version {report.champion_version}"
        labels = {"version": report.champion_version}
        # one alert per drifting replica, labelled with its name (Alertmanager groups them); else one for the model
        drifting = [name for name, verdict in fleet_verdict(report.server)[1].items() if verdict == DRIFT]
        for replica in (drifting if status is Status.DRIFT and drifting else [None]):
            out.append(Alert(ALERT_NAMES[status], SEVERITY[status], model,
                             summary + (f" on replica {replica}" if replica else ""),
                             "\n".join(report.decision.reasons),
                             {**labels, **({"replica": replica} if replica else {})}))
    if report.retrain is not None and report.retrain.promoted:
        r = report.retrain
        out.append(Alert("ChallengerPromoted", "info", model,
                         f"{model}: challenger version {r.challenger_version} promoted to champion",
                         f"gain {r.gate.drop:+.3f} (p={r.gate.p_value:.3g}) over version {r.previous_champion}",
                         {"version": r.challenger_version}))
    out += [Alert("DeploymentRolledBack", "warning", model, f"{model}: deployment rolled back",
                  d.summary(), {"version": d.deployment.version if d.deployment is not None else ""})
            for d in report.deploys if d.action == "rollback"]
    canary = report.canary
    if canary is not None and canary.verdict == "fail":
        out.append(Alert("CanaryFailed", "warning", model, f"{model}: canary {', '.join(canary.canary)} failed version "
                         f"{canary.version}: rolled back to version {canary.previous}", canary.summary().strip(),
                         {"replica": ",".join(canary.canary), "version": canary.version}))
    return out


def rollback_alert(model: str, version: str) -> Alert:
    """The champion alias moved back by hand (`draftops monitor rollback`)."""
    return Alert("ChampionRolledBack", "warning", model, f"{model}: champion rolled back to version {version}",
                 labels={"version": version})


def failed_check_alert(model: str, error: str) -> Alert:
    """A check that crashed before it could report."""
    return Alert(ALERT_NAMES[Status.ERROR], "critical", model, f"ERROR: the monitor check of {model} failed", error)


class StaleWatch:
    """When the last check succeeded (kept in `<state_dir>/last_success.json` across restarts), and whether the
    service has been without one for `stale_after_hours`; alerts once per stale spell."""

    def __init__(self, state_dir: Path, model: str, stale_after_hours: float):
        self.path = Path(state_dir) / LAST_SUCCESS_FILE
        self.model, self.stale_after = model, stale_after_hours * 3600.0
        self.started = time.time()
        self.alerted = False

    def last_success(self) -> float | None:
        try:
            return float(json.loads(self.path.read_text())["last_success"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def succeeded(self, when: float | None = None) -> None:
        self.alerted = False
        try:
            self.path.write_text(json.dumps({"last_success": time.time() if when is None else when}))
        except OSError:
            log.warning("could not record the last successful check in %s", self.path, exc_info=True)

    def current(self, now: float | None = None) -> Alert | None:
        """The MonitorStale alert while no check has succeeded for too long (every time it is asked), else None."""
        now = time.time() if now is None else now
        since = self.last_success() or self.started
        if now - since < self.stale_after:
            return None
        return Alert(STALE, "critical", self.model, f"{self.model}: no successful monitor check for "
                     f"{(now - since) / 3600.0:.1f} h", f"the limit is monitor.alerts.stale_after_hours = "
                     f"{self.stale_after / 3600:g}")

    def due(self, now: float | None = None) -> Alert | None:
        """A MonitorStale alert when none was sent in this spell and no check succeeded for too long."""
        alert = None if self.alerted else self.current(now)
        self.alerted = self.alerted or alert is not None
        return alert


def _rfc3339(when: datetime) -> str:
    return when.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


def alertmanager_body(alerts: Sequence[Alert]) -> list[dict]:
    """Alertmanager API v2's postable alerts: labels (alertname first), annotations, startsAt, endsAt when set."""
    return [{"labels": a.all_labels(), "annotations": {"summary": a.summary, "description": a.description},
             "startsAt": _rfc3339(a.starts_at), **({"endsAt": _rfc3339(a.ends_at)} if a.ends_at else {})}
            for a in alerts]


def _body(kind: str, alerts: Sequence[Alert]) -> list | dict:
    if kind == "alertmanager":
        return alertmanager_body(alerts)
    if kind == "slack":
        return {"text": "\n".join(f"[{'RESOLVED' if a.resolved else a.severity}] {a.summary}"
                                  + (f"\n{a.description}" if a.description and not a.resolved else "")
                                  for a in alerts)}
    status = "resolved" if all(a.resolved for a in alerts) else "firing"
    return {"source": "draftops-monitor", "status": status, "alerts": [
        {"name": a.name, "status": "resolved" if a.resolved else "firing", "severity": a.severity,
         "labels": a.all_labels(), "summary": a.summary, "description": a.description,
         "starts_at": _rfc3339(a.starts_at), "ends_at": a.ends_at and _rfc3339(a.ends_at)} for a in alerts]}


def secret_of(target: AlertTarget) -> str:
    """The target's secret from the environment ("" when none): never in a log line."""
    return os.environ.get(target.secret_env, "") if target.secret_env else ""


def _request(target: AlertTarget, alerts: Sequence[Alert]) -> tuple[str, bytes, dict[str, str]]:
    """(URL, body, headers) of one delivery: a token goes in the Authorization header unless the URL has `{secret}`."""
    secret = secret_of(target)
    url = target.url.replace("{secret}", secret)
    if target.kind == "alertmanager":
        url = url.rstrip("/") + "/api/v2/alerts"
    headers = {"Content-Type": "application/json"}
    if secret and "{secret}" not in target.url:
        headers["Authorization"] = f"Bearer {secret}"
    return url, json.dumps(_body(target.kind, alerts)).encode(), headers


def deliver(target: AlertTarget, alerts: Sequence[Alert], *, tries: int, deadline: float) -> bool:
    """POST `alerts` to `target`: up to `tries` attempts, all within `deadline` seconds; True once one answers 2xx.
    Each attempt is whole within its share of the deadline (`pipeline.deadline_http`: connecting, headers and body);
    a redirect is not followed, so the secret never reaches another origin. A delivery that fails for good is one
    ERROR line with the last attempt's failure (each attempt's is at INFO)."""
    url, body, headers = _request(target, alerts)
    shown = redact(target.url.split("{")[0])
    end = time.monotonic() + deadline
    secret = secret_of(target)
    failure, attempt = f"no attempt within monitor.alerts.deadline = {deadline:g} s", 0
    for attempt in range(1, tries + 1):
        left = end - time.monotonic()
        if left <= 0:
            attempt -= 1
            break
        try:
            answer = exchange(url, data=body, headers=headers, timeout=min(left, REQUEST_TIMEOUT),
                              max_bytes=MAX_ANSWER_BYTES)
            if 200 <= answer.status < 300:
                return True
            failure = answer.said()
        except (OSError, ValueError, http.client.HTTPException) as exc:  # DeadlinePassed is an OSError
            failure = f"{type(exc).__name__}: {exc}"
        failure = failure.replace(secret, "***") if secret else failure
        log.info("alert to %s (%s) failed, attempt %d/%d: %s", target.kind, shown, attempt, tries, failure)
        time.sleep(max(0.0, min(0.5 * attempt, end - time.monotonic())))
    log.error("alert %s not delivered to %s (%s) after %d attempt%s: %s", ", ".join(a.name for a in alerts),
              target.kind, shown, attempt, "" if attempt == 1 else "s", failure)
    return False


def send(config: AlertsConfig, alerts: Sequence[Alert], on_result: OnResult | None = None) -> int:
    """Deliver `alerts` to every target in turn (firing and resolved ones in batches of their own); the number of
    batches delivered. Never raises: failures are logged and given
    to `on_result(kind, False)`."""
    delivered = 0
    batches = [b for b in ([a for a in alerts if not a.resolved], [a for a in alerts if a.resolved]) if b]
    for target in config.targets:
        for batch in batches:  # firing, then resolved: a webhook or Slack gets a message of its own for resolves
            try:
                ok = deliver(target, batch, tries=config.tries, deadline=config.deadline)
            except Exception:
                log.exception("alert %s not delivered to %s", ", ".join(a.name for a in batch), target.kind)
                ok = False
            delivered += ok
            if on_result is not None:
                on_result(target.kind, ok)
    return delivered


def dispatch(cfg: DraftopsConfig, alerts: Sequence[Alert], on_result: OnResult | None = None) -> threading.Thread:
    """Send `alerts` in a background (daemon) thread and return it: the caller never waits for a slow target unless
    it joins; one who joins waits at most targets x `monitor.alerts.deadline`."""
    thread = threading.Thread(target=send, args=(cfg.monitor.alerts, list(alerts), on_result),
                              name="draftops-alerts", daemon=True)
    thread.start()
    return thread


def send_within_deadline(cfg: DraftopsConfig, alerts: Sequence[Alert]) -> None:
    """What a one-off command does once its work is done: send `alerts`, waiting at most each target's deadline (and
    a second), so that the command neither exits before a quick delivery nor hangs on a dead target."""
    if alerts and cfg.monitor.alerts.targets:
        a = cfg.monitor.alerts
        dispatch(cfg, alerts).join(timeout=len(a.targets) * (a.deadline + 1.0))

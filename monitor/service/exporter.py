"""The monitor service's own Prometheus endpoint: the last check's figures, its verdict, the alerts sent and failed,
and /healthz (`monitor.metrics_bind`:`monitor.metrics_port`; port 0: off).

The metrics live in a registry of their own (never prometheus_client's global one), so two services in one process, or
a test beside a service, never share series. Per-replica figures come from the report's fleet reading; a check that
read no engine exposes the model-wide series alone, and a replica that left the fleet (or every replica, when a check
reads no engine) loses its series at the next check that reports, so a dashboard never shows a departed replica's
last figures as current. After a restart the figures of the last check before it are shown (kept in
`<monitor.state_dir>/last_check.json`; `last_check_timestamp_seconds` says when that check ended) until the next
check, and the last success from `last_success.json`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, make_wsgi_app

from monitor.check.decision import Status
from monitor.check.outcome import CheckReport
from monitor.fleet.verdicts import COLLECTING, DEPLOY_MISMATCH, DRIFT, IDLE, OK, UNREACHABLE
from pipeline.config import DraftopsConfig
from pipeline.files import write_text_atomic

log = logging.getLogger("draftops.monitor")

PREFIX = "draftops_monitor_"
REPLICA_VERDICTS = (OK, DRIFT, IDLE, UNREACHABLE, COLLECTING, DEPLOY_MISMATCH)
FIGURES_FILE = "last_check.json"


READ_TIMEOUT = 10.0  # seconds a client may leave the connection silent
CONNECTION_DEADLINE = 30.0  # seconds one connection may last in all (a client that trickles its request)


class _QuietHandler(WSGIRequestHandler):
    """One connection, in a thread of its own: each read waits at most READ_TIMEOUT, and the connection is cut after
    CONNECTION_DEADLINE whatever the client does, so no client holds a thread for long."""

    timeout = READ_TIMEOUT

    def setup(self) -> None:
        super().setup()
        self._cutoff = threading.Timer(CONNECTION_DEADLINE, self._cut)
        self._cutoff.daemon = True
        self._cutoff.start()

    def _cut(self) -> None:
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)  # wakes the thread's blocked read

    def finish(self) -> None:
        self._cutoff.cancel()
        with contextlib.suppress(OSError):
            super().finish()

    def log_message(self, format, *args):  # noqa: A002 - a scrape every few seconds is not worth a log line
        pass


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    """wsgiref's server with a thread per connection: a client that sends half a request and waits blocks only its
    own thread, never /healthz or a scrape."""

    daemon_threads = True
    block_on_close = False

    def handle_error(self, request, client_address) -> None:
        log.debug("metrics endpoint: a client %s failed", client_address, exc_info=True)


def _version_number(version: str | None) -> float:
    try:
        return float(version)
    except (TypeError, ValueError):
        return float("nan")


class ServiceMetrics:
    """The gauges and counters of one monitor service, in their own CollectorRegistry."""

    def __init__(self, model: str):
        self.model = model
        self.registry = CollectorRegistry(auto_describe=True)
        r, m = self.registry, ["model"]
        self.acceptance = Gauge(PREFIX + "acceptance", "Champion's acceptance at the last check", m, registry=r)
        self.baseline = Gauge(PREFIX + "acceptance_baseline", "Champion's baseline acceptance", m, registry=r)
        self.break_even = Gauge(PREFIX + "break_even_acceptance", "Acceptance below which drafting does not pay", m,
                                registry=r)
        self.replica_acceptance = Gauge(PREFIX + "replica_acceptance", "A serving replica's acceptance at the last "
                                        "check", ["model", "replica"], registry=r)
        self.replica_baseline = Gauge(PREFIX + "replica_acceptance_baseline", "A serving replica's baseline "
                                      "acceptance (its baseline windows)", ["model", "replica"], registry=r)
        self.replica_verdict = Gauge(PREFIX + "replica_verdict", "1 for a replica's verdict at the last check, 0 for "
                                     "the others", ["model", "replica", "verdict"], registry=r)
        self.replica_running = Gauge(PREFIX + "replica_running_requests", "A serving replica's running requests "
                                     "(mean over its window) at the last check", ["model", "replica"], registry=r)
        self.replica_past_boundary = Gauge(PREFIX + "replica_past_boundary", "1 when a replica ran past the "
                                           "concurrency where speculation stopped paying (monitor.engine_boundary)",
                                           ["model", "replica"], registry=r)
        self.verdict = Gauge(PREFIX + "verdict", "1 for the last check's verdict, 0 for the others",
                             ["model", "verdict"], registry=r)
        self.champion = Gauge(PREFIX + "champion_version", "Registered version behind the champion alias", m,
                              registry=r)
        self.duration = Gauge(PREFIX + "check_duration_seconds", "Wall time of the last check", m, registry=r)
        self.last_check = Gauge(PREFIX + "last_check_timestamp_seconds", "When the last check ended", m, registry=r)
        self.last_success = Gauge(PREFIX + "last_success_timestamp_seconds", "When the last check that reached a "
                                  "verdict other than ERROR ended", m, registry=r)
        self.checks = Counter(PREFIX + "checks", "Checks run, by exit code", ["model", "exit_code"], registry=r)
        self.alerts_sent = Counter(PREFIX + "alerts_sent", "Alert batches delivered", ["model", "target"], registry=r)
        self.alerts_failed = Counter(PREFIX + "alerts_failed", "Alert batches not delivered after every try",
                                     ["model", "target"], registry=r)
        self._replicas: set[str] = set()  # the replicas whose series are exposed now
        self._loaded: set[str] = set()  # the replicas whose running requests are exposed now
        self.figures: dict = {"ended": None, "seconds": None}  # what the gauges show (saved across restarts)

    def record_alert(self, target: str, delivered: bool) -> None:
        (self.alerts_sent if delivered else self.alerts_failed).labels(self.model, target).inc()

    def record_check(self, report: CheckReport | None, exit_code: int, seconds: float, ended: float | None = None
                     ) -> None:
        """The figures of a finished check; `report` None: it crashed (or the lock was busy) before reporting, and
        the last report's figures stay."""
        ended = time.time() if ended is None else ended
        self.checks.labels(self.model, str(exit_code)).inc()
        if report is None:
            self.figures = {**self.figures, "ended": ended, "seconds": seconds}
        else:
            self.figures = report_figures(report, seconds, ended)
        self.show(self.figures)

    def show(self, figures: dict) -> None:
        """Set the gauges to `figures` (report_figures' dict, or the one saved on disk before a restart)."""
        self.duration.labels(self.model).set(figures["seconds"])
        self.last_check.labels(self.model).set(figures["ended"])
        if figures.get("last_success") is not None:
            self.last_success.labels(self.model).set(figures["last_success"])
        status = figures.get("verdict")
        if status is None:
            return
        for s in Status:
            self.verdict.labels(self.model, s.value).set(float(s.value == status))
        self.champion.labels(self.model).set(_version_number(figures["champion"]))
        for gauge, key in ((self.acceptance, "acceptance"), (self.baseline, "baseline"),
                           (self.break_even, "break_even")):
            if figures.get(key) is None:  # no break-even measured, say: no series rather than a made-up one
                _remove(gauge, self.model)
            else:
                gauge.labels(self.model).set(figures[key])
        reported = {replica for replica, *_ in figures["replicas"]}
        self._forget_replicas(self._replicas - reported)
        self._replicas = reported
        for replica, acceptance, baseline, verdict in figures["replicas"]:
            for gauge, value in ((self.replica_acceptance, acceptance), (self.replica_baseline, baseline)):
                if value is None:  # unknown at this check: no figure rather than the last one
                    _remove(gauge, self.model, replica)
                else:
                    gauge.labels(self.model, replica).set(value)
            for name in REPLICA_VERDICTS:
                self.replica_verdict.labels(self.model, replica, name).set(float(name == verdict))
        self._show_load(figures.get("load", {}))

    def _show_load(self, load: dict) -> None:
        """Each replica's running requests and whether they were past the boundary; a replica no longer reported
        loses its series."""
        for replica in self._loaded - set(load):
            _remove(self.replica_running, self.model, replica)
            _remove(self.replica_past_boundary, self.model, replica)
        self._loaded = set(load)
        for replica, (running, past) in load.items():
            self.replica_running.labels(self.model, replica).set(running)
            self.replica_past_boundary.labels(self.model, replica).set(float(past))

    def _forget_replicas(self, replicas: set[str]) -> None:
        """Drop the per-replica series of replicas the last check no longer reported."""
        for replica in replicas:
            for gauge in (self.replica_acceptance, self.replica_baseline):
                _remove(gauge, self.model, replica)
            for name in REPLICA_VERDICTS:
                _remove(self.replica_verdict, self.model, replica, name)


def _remove(gauge: Gauge, *labels: str) -> None:
    try:
        gauge.remove(*labels)
    except KeyError:  # never set: a replica without a baseline, say
        pass


def report_figures(report: CheckReport, seconds: float, ended: float) -> dict:
    """What /metrics shows of a finished check, as plain JSON (kept on disk for the next start)."""
    status = report.decision.status
    return {"ended": ended, "seconds": seconds, "verdict": status.value, "champion": report.champion_version,
            "last_success": ended if status is not Status.ERROR else None,
            "acceptance": report.current_acceptance, "baseline": _baseline(report), "break_even": report.break_even,
            "replicas": [list(f) for f in _replica_figures(report)], "load": dict(report.load)}


def save_figures(cfg: DraftopsConfig, metrics: ServiceMetrics) -> None:
    """Keep what /metrics shows in `<monitor.state_dir>/last_check.json`, for the service's next start."""
    try:
        write_text_atomic(Path(cfg.monitor.state_dir).resolve() / FIGURES_FILE, json.dumps(metrics.figures))
    except OSError:
        log.warning("could not keep the last check's figures", exc_info=True)


def restore_figures(cfg: DraftopsConfig, metrics: ServiceMetrics, last_success: float | None) -> bool:
    """Show the figures of the last check before this start (their time is last_check_timestamp_seconds) and the
    last success; False when there are none on disk."""
    try:
        figures = json.loads((Path(cfg.monitor.state_dir).resolve() / FIGURES_FILE).read_text())
    except (OSError, ValueError):
        figures = None
    if figures and figures.get("ended") is not None:
        metrics.figures = figures
        metrics.show(figures)
    if last_success is not None:
        metrics.last_success.labels(metrics.model).set(last_success)
    return bool(figures)


def _baseline(report: CheckReport) -> float | None:
    if report.baseline_recorded:
        return report.current_acceptance
    for test in (report.acceptance and report.acceptance.paired, report.acceptance and report.acceptance.unpaired):
        if test is not None:
            return test.baseline_acceptance
    return None


def _replica_figures(report: CheckReport) -> list[tuple[str, float | None, float | None, str]]:
    """(replica, recent acceptance, baseline acceptance, verdict) for each replica of the report's fleet reading; []
    when the check read no engine. The acceptance is the recent windows' where the replica was tested, else its
    latest window's."""
    if report.server is None:
        return []
    out = []
    for replica in report.server.replicas:
        test = replica.test
        latest = replica.latest.counters.acceptance if replica.latest is not None else None
        out.append((replica.name, test.current_acceptance if test is not None else latest,
                    test.baseline_acceptance if test is not None else None, replica.verdict))
    return out


def service_app(metrics: ServiceMetrics, healthy: Callable[[], bool]):
    """WSGI app: /healthz (200 while `healthy()`, else 503), anything else prometheus_client's metrics app."""
    metrics_app = make_wsgi_app(metrics.registry)

    def app(environ, start_response):
        if environ.get("PATH_INFO") == "/healthz":
            ok = healthy()
            start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
            return [b"ok\n" if ok else b"scheduler not running\n"]
        return metrics_app(environ, start_response)

    return app


class MetricsServer:
    """The WSGI app served from a daemon thread, each connection in a thread of its own with a deadline
    (`_QuietHandler`); `stop()` closes the socket."""

    def __init__(self, metrics: ServiceMetrics, healthy: Callable[[], bool], bind: str, port: int):
        self.httpd: WSGIServer = make_server(bind, port, service_app(metrics, healthy), server_class=_ThreadingServer,
                                             handler_class=_QuietHandler)
        self.port = self.httpd.server_port
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="draftops-metrics", daemon=True)
        self.thread.start()
        log.info("monitor metrics on http://%s:%d/metrics", bind, self.port)

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

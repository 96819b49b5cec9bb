"""The monitor service: runs the check on a cron schedule that survives restarts.

APScheduler 3 with a persistent SQLAlchemy (sqlite) job store holds one job, referenced by import
path so it can be stored: `monitor.service.scheduler:run_scheduled_check(config_path)`. Restarting the service
re-registers the job under the same id (`replace_existing=True`, so config changes apply) but keeps
the stored next run time while the schedule is unchanged: a check missed while the service was
down then runs once (`coalesce=True`) if it is less than `misfire_grace_time` late. A file lock
keeps a scheduled check, a manual `draftops monitor check` and a retrain from ever overlapping. Beside it, without
Prometheus, an in-memory interval job scrapes the serving engines every `monitor.scrape_interval_minutes` into the
window store (monitor.fleet.window_store), on its own thread and without the lock.

After each check, with the lock released, the running service records its figures on its own /metrics
(monitor.service.exporter) and sends the alerts it is worth (monitor.service.alerts) from a background thread.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from pathlib import Path

from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.jobstores.memory import MemoryJobStore
from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.schedulers.base import STATE_STOPPED
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger
from apscheduler.util import ref_to_obj

from monitor.check.decision import EXIT_ERROR, Status
from monitor.check.outcome import CheckReport
from monitor.service import alert_book, alerts
from monitor.service.exporter import MetricsServer, ServiceMetrics, restore_figures, save_figures
from pipeline import locks
from pipeline import metrics as M
from pipeline.config import DraftopsConfig, load_config
from pipeline.locks import ModelBusy, model_lock
from pipeline.tracking import TrackingUnavailable, check_tracking, start_run, tracking_uri

log = logging.getLogger("draftops.monitor")

JOB_ID = "draftops-monitor-check"
SCHEDULED_JOB = "monitor.service.scheduler:run_scheduled_check"
DEFAULT_CHECK = "monitor.check.run:scheduled_check"  # callable(cfg) -> CheckReport or exit code, under the lock
SCRAPE_JOB_ID = "draftops-engine-scrape"
SCRAPE_JOB = "monitor.fleet.window_store:scrape_job"  # the engines' windows between checks (no Prometheus)
EXIT_BUSY = locks.EXIT_BUSY  # another check or retrain holds the lock; try again later
STALE_POLL_SECONDS = 60.0  # how often the service looks whether no check has succeeded for too long

AfterCheck = Callable[[DraftopsConfig, "CheckReport | None", int, float], None]  # (cfg, report, exit code, seconds)
_after_check_hooks: list[AfterCheck] = []  # the running service's: its /metrics and its alerts


def state_dir(cfg: DraftopsConfig) -> Path:
    path = Path(cfg.monitor.state_dir).resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def jobstore_path(cfg: DraftopsConfig) -> Path:
    return state_dir(cfg) / "jobs.sqlite"


@contextlib.contextmanager
def check_lock(cfg: DraftopsConfig, timeout: float | None = None) -> Iterator[None]:
    """Hold the registered model's lock (`pipeline.locks.model_lock`, shared by every process that changes the
    model, whatever its working directory) for a whole check, retraining and promotion included; wait up to `timeout`
    (default cfg.monitor.lock_timeout), else raise `ModelBusy`."""
    wait = cfg.monitor.lock_timeout if timeout is None else timeout
    with model_lock(cfg.tracking.registered_model, tracking_uri(cfg), timeout=wait):
        yield


def log_failed_check(cfg: DraftopsConfig, error: BaseException) -> None:
    """Record a crashed check as a FAILED run in the monitor experiment, when tracking is reachable."""

    class _Failed(Exception):
        pass

    try:
        import mlflow

        with start_run(cfg, "monitor", run_name="check-failed",
                       tags={M.MONITOR_DECISION_TAG: "ERROR", M.MONITOR_ERROR_TAG: type(error).__name__}):
            mlflow.log_text("".join(traceback.format_exception(error)), "error.txt")
            raise _Failed  # leaving the run with an exception marks it FAILED
    except _Failed:
        pass
    except Exception:  # tracking down must not take the service down
        log.warning("could not record the failed check in MLflow", exc_info=True)


def run_scheduled_check(config_path: str | None, check: str = DEFAULT_CHECK, overrides: Sequence[str] = ()) -> int:
    """The scheduled job: load the config (with the service's `key=value` overrides), take the lock, run `check`
    (import path of f(cfg) -> int).

    Never raises: a busy lock returns EXIT_BUSY, any failure is logged (and tracked) and returns EXIT_ERROR,
    so the scheduler, and the service with it, stays up.
    """
    cfg, report, started = None, None, time.monotonic()
    try:
        cfg = load_config(config_path, overrides)
        check_tracking(cfg)
        with check_lock(cfg):
            log.info("monitor check starting (%s)", check)
            result = ref_to_obj(check)(cfg)
            report = result if isinstance(result, CheckReport) else None
            code = report.exit_code if report is not None else int(result)
            log.info("monitor check finished with exit code %d", code)
    except ModelBusy as exc:
        log.warning("monitor check skipped: %s", exc)
        return EXIT_BUSY
    except TrackingUnavailable as exc:  # nowhere to track the failure either
        log.error("monitor check failed: %s", exc)
        code = EXIT_ERROR
    except Exception as exc:
        log.exception("monitor check failed")
        if cfg is not None:
            log_failed_check(cfg, exc)
        code = EXIT_ERROR
    if cfg is not None:  # the lock is released: the service's metrics and alerts never hold it
        for hook in list(_after_check_hooks):
            try:
                hook(cfg, report, code, time.monotonic() - started)
            except Exception:
                log.exception("recording the check's metrics and alerts failed")
    return code


class MetricsPortTaken(RuntimeError):
    """The service's /metrics port cannot be bound: the service stops (exit 2)."""


class _Scheduler(BackgroundScheduler):
    """BackgroundScheduler whose loop does no job pass after shutdown.

    APScheduler 3.11's loop wakes once more after `shutdown()` and processes due jobs while stopped:
    a due check then fails to reach the stopped executor and its next run time is advanced anyway, so
    that run is lost. Skipping that pass leaves it due in the job store for the next start.
    """

    def _process_jobs(self):
        if self.state == STATE_STOPPED:
            return None
        return super()._process_jobs()


class MonitorService:
    """A background scheduler with the check job in a persistent sqlite job store."""

    def __init__(self, config_path: str | Path | None, *, check: str = DEFAULT_CHECK, overrides: Sequence[str] = ()):
        """config_path: the YAML config each check loads afresh; None: the default config (`load_config(None)`);
        `overrides`: `key=value` settings each check applies to it."""
        self.config_path = None if config_path is None else str(Path(config_path).resolve())
        self.overrides = list(overrides)
        self.cfg = load_config(self.config_path, self.overrides)
        self.check = check
        self.scheduler = _Scheduler(
            jobstores={"default": SQLAlchemyJobStore(url=f"sqlite:///{jobstore_path(self.cfg)}"),
                       "memory": MemoryJobStore()},
            executors={"default": ThreadPoolExecutor(1), "scrape": ThreadPoolExecutor(1)},
            timezone=self.cfg.monitor.timezone,
        )
        self.metrics = ServiceMetrics(self.cfg.tracking.registered_model)
        self.stale = alerts.StaleWatch(state_dir(self.cfg), self.cfg.tracking.registered_model,
                                       self.cfg.monitor.alerts.stale_after_hours)
        self.metrics_server: MetricsServer | None = None
        restore_figures(self.cfg, self.metrics, self.stale.last_success())

    def trigger(self) -> CronTrigger:
        return CronTrigger.from_crontab(self.cfg.monitor.schedule, timezone=self.cfg.monitor.timezone)

    def start(self, *, run_now: bool = False) -> None:
        self._serve_metrics()  # first: a taken port stops the service before anything runs
        self.scheduler.start(paused=True)  # job stores open, nothing runs until the job is reconciled
        self._register_job()
        self._register_scrape()
        _after_check_hooks.append(self.after_check)
        if run_now:
            self.run_now()
        self.scheduler.resume()
        log.info("monitor service started; next check at %s", self.next_run_time())

    def _register_job(self) -> None:
        trigger = self.trigger()
        stored = self.scheduler.get_job(JOB_ID)
        keep = {}
        if (stored is not None and stored.next_run_time is not None
                and (str(stored.trigger), str(stored.trigger.timezone)) == (str(trigger), str(trigger.timezone))):
            keep["next_run_time"] = stored.next_run_time  # a check missed while down stays due
        args = [self.config_path] if self.check == DEFAULT_CHECK else [self.config_path, self.check]
        if self.overrides:
            args = [self.config_path, self.check, self.overrides]
        self.scheduler.add_job(
            SCHEDULED_JOB, trigger=trigger, args=args, id=JOB_ID, name="draftops monitor check",
            replace_existing=True, coalesce=True, max_instances=1,
            misfire_grace_time=self.cfg.monitor.misfire_grace_time, **keep)

    def _register_scrape(self) -> None:
        """Scrape the engines every monitor.scrape_interval_minutes, from now on, in a thread of its own (a long check
        never delays it), when the monitor scrapes them itself: engines listed, no Prometheus."""
        m = self.cfg.monitor
        if m.prometheus_url or not m.replica_endpoints() or m.scrape_interval_minutes <= 0:
            return
        self.scheduler.add_job(
            SCRAPE_JOB, trigger=IntervalTrigger(minutes=m.scrape_interval_minutes), args=[self.config_path],
            id=SCRAPE_JOB_ID, name="draftops engine scrape", jobstore="memory", executor="scrape",
            replace_existing=True, coalesce=True, max_instances=1, next_run_time=datetime.now(self.scheduler.timezone))

    def _serve_metrics(self) -> None:
        """Serve /metrics and /healthz unless `monitor.metrics_port` is 0; MetricsPortTaken when the port cannot be
        bound (a service without its /metrics would look healthy to whoever asks the other process on that port)."""
        m = self.cfg.monitor
        if m.metrics_port:
            try:
                self.metrics_server = MetricsServer(self.metrics, self.healthy, m.metrics_bind, m.metrics_port)
            except OSError as exc:
                raise MetricsPortTaken(f"monitor.metrics_port: cannot serve /metrics on {m.metrics_bind}:"
                                       f"{m.metrics_port}: {exc.strerror or exc}") from None

    def healthy(self) -> bool:
        return bool(self.scheduler.running)

    def after_check(self, cfg: DraftopsConfig, report: CheckReport | None, code: int, seconds: float) -> None:
        """A check ended (lock released): record its figures, then send every active alert again and a resolve for
        each cleared one (monitor.service.alert_book), in the background."""
        self.metrics.record_check(report, code, seconds)
        save_figures(cfg, self.metrics)
        raised = alerts.report_alerts(report) if report is not None else []
        judged = report is not None and report.decision.status is not Status.ERROR
        if judged:
            self.stale.succeeded()
        elif report is None and code == EXIT_ERROR:
            raised.append(alerts.failed_check_alert(cfg.tracking.registered_model, "see the service's log and the "
                                                    "check's FAILED run in the draftops-monitor experiment"))
        stale = self.stale.current()
        if stale is not None:
            self.stale.alerted = True
            raised.append(stale)
        pending = alert_book.lifecycle(cfg, raised, alert_book.CONDITIONS if judged else frozenset())
        if pending:
            alerts.dispatch(cfg, pending, self.metrics.record_alert)

    def alert_if_stale(self) -> None:
        stale = self.stale.due()
        if stale is not None:
            alerts.dispatch(self.cfg, alert_book.lifecycle(self.cfg, [stale]), self.metrics.record_alert)

    def run_now(self) -> None:
        """Make the scheduled job due now; afterwards it follows its schedule again."""
        self.scheduler.modify_job(JOB_ID, next_run_time=datetime.now(self.scheduler.timezone))
        if self.scheduler.running:
            self.scheduler.wakeup()

    def next_run_time(self) -> datetime | None:
        job = self.scheduler.get_job(JOB_ID)
        return job.next_run_time if job is not None else None

    def stop(self) -> None:
        """Stop scheduling; a check already running is allowed to finish."""
        if self.scheduler.running:
            self.scheduler.shutdown(wait=True)
        if self.after_check in _after_check_hooks:
            _after_check_hooks.remove(self.after_check)
        if self.metrics_server is not None:
            self.metrics_server.stop()
            self.metrics_server = None


def serve(config_path: str | Path | None, *, run_now: bool = False, check: str = DEFAULT_CHECK,
          stop_event: threading.Event | None = None, overrides: Sequence[str] = ()) -> int:
    """Run the service until SIGTERM/SIGINT (or `stop_event`), then shut down cleanly; returns 0 (EXIT_ERROR, 2,
    when its /metrics port is taken)."""
    stop = stop_event or threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda signum, frame: stop.set())
    service = MonitorService(config_path, check=check, overrides=overrides)
    try:
        try:
            service.start(run_now=run_now)
        except MetricsPortTaken as exc:
            print(f"draftops: error: {exc}", file=sys.stderr)
            return EXIT_ERROR
        last_poll = time.monotonic()
        while not stop.wait(0.5):
            if time.monotonic() - last_poll >= STALE_POLL_SECONDS:
                last_poll = time.monotonic()
                service.alert_if_stale()
        log.info("monitor service stopping")
    finally:
        service.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log.info("monitor service stopped")
    return 0

import http.server
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from monitor.fleet.window_store import load_store, store_path
from monitor.service.scheduler import EXIT_BUSY, JOB_ID, MonitorService, jobstore_path, run_scheduled_check
from pipeline import metrics as M
from pipeline.config import ConfigError, load_config
from tests.monitor.fleet.test_counters import RECORDED, plus, vllm_text

REPO = Path(__file__).resolve().parents[3]
MARKER = "tests.monitor.jobs:append_marker"
SLOW = "tests.monitor.jobs:slow_marker"
CRASH = "tests.monitor.jobs:crash"


def write_config(tmp_path, **monitor) -> Path:
    path = tmp_path / "monitor.yaml"
    data = {
        "tracking": {"uri": f"sqlite:///{tmp_path}/mlflow.db", "system_metrics": False},  # where mlflow_uri puts its db
        # /metrics off unless a test asks for it: a service on this machine may hold the default port
        "monitor": {"state_dir": str(tmp_path / "state"), "metrics_port": 0, **monitor},
    }
    path.write_text(yaml.safe_dump(data))
    return path


def stored_jobs(cfg_path) -> list[tuple[str, float]]:
    with sqlite3.connect(jobstore_path(load_config(cfg_path))) as db:
        return db.execute("SELECT id, next_run_time FROM apscheduler_jobs").fetchall()


def runs_log(cfg_path) -> list[str]:
    path = Path(load_config(cfg_path).monitor.state_dir) / "runs.log"
    return path.read_text().split("\n")[:-1] if path.exists() else []


def wait_for(predicate, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_restart_keeps_one_job_and_its_schedule(tmp_path):
    cfg = write_config(tmp_path)
    for _ in range(3):
        service = MonitorService(cfg)
        service.start()
        service.stop()
    jobs = stored_jobs(cfg)
    assert len(jobs) == 1 and jobs[0][0] == JOB_ID
    next_run = datetime.fromtimestamp(jobs[0][1], timezone.utc)
    assert (next_run.hour, next_run.minute) == (2, 0)  # nightly 02:00 UTC
    service = MonitorService(cfg)
    service.scheduler.start(paused=True)
    job = service.scheduler.get_job(JOB_ID)
    assert (job.coalesce, job.max_instances, job.misfire_grace_time) == (True, 1, 3600)
    assert str(job.trigger) == str(service.trigger())
    service.scheduler.shutdown()

    # a changed schedule replaces the job (still one) and its next run time
    cfg = write_config(tmp_path, schedule="30 4 * * *")
    service = MonitorService(cfg)
    service.start()
    assert (service.next_run_time().hour, service.next_run_time().minute) == (4, 30)
    service.stop()
    assert len(stored_jobs(cfg)) == 1


def _miss_the_last_check(cfg, minutes_late: float) -> None:
    """Emulate downtime: the stored job's next run lies `minutes_late` minutes in the past."""
    service = MonitorService(cfg, check=MARKER)
    service.start()
    service.stop()
    service = MonitorService(cfg, check=MARKER)
    service.scheduler.start(paused=True)
    past = datetime.now(service.scheduler.timezone) - timedelta(minutes=minutes_late)
    service.scheduler.modify_job(JOB_ID, next_run_time=past)
    service.scheduler.shutdown()


def test_missed_check_runs_once_after_restart_within_grace(tmp_path):
    cfg = write_config(tmp_path)
    _miss_the_last_check(cfg, minutes_late=5)
    service = MonitorService(cfg, check=MARKER)
    service.start()
    try:
        assert wait_for(lambda: len(runs_log(cfg)) >= 1)
        time.sleep(1.0)
        assert len(runs_log(cfg)) == 1
        assert service.next_run_time() > datetime.now(service.scheduler.timezone)
    finally:
        service.stop()
    assert len(stored_jobs(cfg)) == 1


def test_missed_check_beyond_grace_is_skipped(tmp_path):
    cfg = write_config(tmp_path, misfire_grace_time=60)
    _miss_the_last_check(cfg, minutes_late=5)
    service = MonitorService(cfg, check=MARKER)
    service.start()
    time.sleep(1.5)
    service.stop()
    assert runs_log(cfg) == []
    assert stored_jobs(cfg)[0][1] > time.time()


def test_lock_never_runs_two_checks_at_once(tmp_path):
    cfg = write_config(tmp_path)  # lock_timeout 0: the second check exits cleanly
    codes = []
    threads = [threading.Thread(target=lambda: codes.append(run_scheduled_check(str(cfg), SLOW))) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.2)
    for t in threads:
        t.join()
    assert sorted(codes) == [0, EXIT_BUSY]
    assert [line.split()[0] for line in runs_log(cfg)] == ["start", "end"]

    waiting = write_config(tmp_path, lock_timeout=10)  # the second check waits, then runs after the first
    (Path(load_config(waiting).monitor.state_dir) / "runs.log").unlink()
    codes.clear()
    threads = [threading.Thread(target=lambda: codes.append(run_scheduled_check(str(waiting), SLOW)))
               for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.2)
    for t in threads:
        t.join()
    assert codes == [0, 0]
    assert [line.split()[0] for line in runs_log(waiting)] == ["start", "end", "start", "end"]


def test_crashing_check_leaves_service_up_and_is_tracked_as_failed(tmp_path, mlflow_uri):
    import mlflow
    from apscheduler.events import EVENT_JOB_ERROR, EVENT_JOB_EXECUTED
    from mlflow import MlflowClient

    cfg = write_config(tmp_path)
    service = MonitorService(cfg, check=CRASH)
    finished = []
    service.scheduler.add_listener(lambda event: finished.append(event), EVENT_JOB_EXECUTED | EVENT_JOB_ERROR)
    service.start(run_now=True)
    try:
        assert wait_for(lambda: len(finished) == 1, timeout=60)
        assert finished[0].retval == 2  # EXIT_ERROR, the scheduler saw no exception
        service.run_now()
        assert wait_for(lambda: len(finished) == 2, timeout=60)
        assert [line.split()[0] for line in runs_log(cfg)] == ["crash", "crash"]
        assert service.scheduler.running and service.next_run_time().hour == 2
    finally:
        service.stop()
    mlflow.set_tracking_uri(load_config(cfg).tracking.uri)
    experiment = MlflowClient().get_experiment_by_name("draftops-monitor")
    runs = MlflowClient().search_runs([experiment.experiment_id])
    assert len(runs) == 2
    assert {r.info.status for r in runs} == {"FAILED"}
    assert {r.data.tags["draftops.monitor.error"] for r in runs} == {"RuntimeError"}


def test_serve_stops_cleanly_on_sigterm(tmp_path):
    cfg = write_config(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "monitor", "serve", "--config", str(cfg)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        assert wait_for(lambda: any("monitor service started" in line for line in lines), timeout=60), lines
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=5)
    assert any("monitor service stopped" in line for line in lines), lines
    assert len(stored_jobs(cfg)) == 1


@pytest.mark.parametrize("schedule", ["not a cron", "61 2 * * *"])
def test_bad_schedule_fails_when_the_config_is_loaded(tmp_path, schedule):
    cfg = write_config(tmp_path, schedule=schedule)
    with pytest.raises(ConfigError, match="monitor.schedule: .*not a crontab expression"):
        MonitorService(cfg)


def test_serve_without_a_config_uses_the_default_config(tmp_path, monkeypatch):
    """`draftops monitor serve` with no --config, as its help promises (it was a TypeError)."""
    monkeypatch.chdir(tmp_path)  # the default config keeps its state and MLflow store in the working directory
    service = MonitorService(None)
    assert service.config_path is None and service.cfg == load_config(None)
    service.start()
    try:
        job = service.scheduler.get_job(JOB_ID)
        assert job.args == (None,) and service.next_run_time() is not None
    finally:
        service.stop()
    assert (tmp_path / load_config(None).monitor.state_dir).is_dir()


def test_the_service_scrapes_the_engines_between_checks_on_its_own_thread(tmp_path, mlflow_uri):
    """Without Prometheus the service reads every listed engine every scrape_interval_minutes (here 0.6 s) into the
    window store, whatever the check does; a busy check job never holds it up."""
    served = []

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # each scrape finds 100 more drafts
            served.append(1)
            body = vllm_text(plus(RECORDED, 100 * len(served), 500 * len(served), 300 * len(served),
                                  (0,) * 5)).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    client = MlflowClient()
    client.create_registered_model("draftops-draft")
    client.create_model_version("draftops-draft", source="file:///nonexistent")
    client.set_registered_model_alias("draftops-draft", M.CHAMPION, "1")
    cfg_path = write_config(tmp_path, scrape_interval_minutes=0.01,
                            engines=[{"url": f"http://127.0.0.1:{httpd.server_port}/metrics", "replica": "a"}])
    service = MonitorService(cfg_path, check=SLOW)
    try:
        service.start(run_now=True)  # the check job sleeps; the scrape job runs beside it
        cfg = load_config(cfg_path)
        assert wait_for(lambda: len(load_store(store_path(cfg))["replicas"].get("a", {}).get("versions", {})
                                    .get("1", {}).get("baseline", [])) >= 2, timeout=20)
    finally:
        service.stop()
        httpd.shutdown()
        httpd.server_close()

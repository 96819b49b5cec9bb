"""Tracking that cannot be reached fails at once, naming the store, before any work (not after a 30-minute job)."""
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException

from pipeline import registry
from pipeline.config import load_config
from pipeline.tracking import TrackingUnavailable, check_tracking

REPO = Path(__file__).resolve().parents[2]


def closed_port_uri() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_check_tracking_names_the_uri_of_a_closed_port():
    uri = closed_port_uri()
    with pytest.raises(TrackingUnavailable, match=uri.replace(".", r"\.")):
        check_tracking(load_config(None, [f"tracking.uri={uri}"]), timeout=5)


def test_check_tracking_on_sqlite_stores(tmp_path):
    assert check_tracking(load_config(None, [f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"])).endswith("mlflow.db")
    with pytest.raises(TrackingUnavailable, match="does not exist"):
        check_tracking(load_config(None, [f"tracking.uri=sqlite:///{tmp_path}/missing/mlflow.db"]))


@pytest.mark.parametrize("argv", [
    ["monitor", "check"], ["distill"], ["monitor", "rollback"], ["monitor", "rollback", "--to-version", "2"],
    ["report"], ["models", "info", "models:/draftops-draft@champion"], ["monitor", "serve"],
])
def test_an_unreachable_tracking_server_exits_2_within_30_s(tmp_path, argv):
    """Every command an operator runs during an outage fails at once with one line naming the server (rollback
    retried for 266 s, report and models info ran past 200 s, serve started a service that could track nothing)."""
    uri = closed_port_uri()
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": str(REPO), "DRAFTOPS_HOME": str(tmp_path)}
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", *argv], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert time.monotonic() - start < 30
    assert f"the MLflow tracking server {uri} does not answer" in out.stderr
    assert "Traceback" not in out.stderr and out.stderr.strip().count("\n") == 0, out.stderr[-2000:]


def test_a_registry_call_against_a_dead_server_gives_up_within_30_s_naming_it(monkeypatch):
    """A promotion (any registry call) whose server went down after the check started: MLflow's own client retried
    for minutes; bounded by tracking.http_timeout and tracking.http_retries it fails in seconds, and its one line
    names the server."""
    import mlflow.tracking._model_registry.utils as registry_uri
    import mlflow.tracking._tracking_service.utils as tracking_uri

    from pipeline.tracking import setup_mlflow, store_error_line

    uri = closed_port_uri()
    for knob in ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
                 "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"):
        monkeypatch.setenv(knob, "")  # restored (unset) after the test, as are the URIs below
        monkeypatch.delenv(knob)
    monkeypatch.setattr(tracking_uri, "_tracking_uri", tracking_uri._tracking_uri)
    monkeypatch.setattr(registry_uri, "_registry_uri", registry_uri._registry_uri)
    setup_mlflow(load_config(None, [f"tracking.uri={uri}"]))
    start = time.monotonic()
    with pytest.raises(MlflowException) as err:
        registry.promote("draftops-draft", "2", lock_timeout=0)
    assert time.monotonic() - start < 30
    line = store_error_line(err.value)
    assert line.startswith(f"the MLflow store {uri} failed: ") and "127.0.0.1" in line and "\n" not in line


def test_a_store_failure_is_not_mistaken_for_a_missing_alias(monkeypatch):
    class Down:
        def get_model_version_by_alias(self, name, alias):
            raise MlflowException("connection refused", error_code="INTERNAL_ERROR")

    monkeypatch.setattr(registry, "_client", Down)
    with pytest.raises(MlflowException, match="connection refused"):
        registry.champion("draftops-draft")

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


@pytest.mark.parametrize("argv", [["monitor", "check"], ["distill"]])
def test_an_unreachable_tracking_server_exits_2_within_30_s(tmp_path, argv):
    uri = closed_port_uri()
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": str(REPO), "DRAFTOPS_HOME": str(tmp_path)}
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", *argv], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert time.monotonic() - start < 30
    assert f"the MLflow tracking server {uri} does not answer" in out.stderr


def test_a_store_failure_is_not_mistaken_for_a_missing_alias(monkeypatch):
    class Down:
        def get_model_version_by_alias(self, name, alias):
            raise MlflowException("connection refused", error_code="INTERNAL_ERROR")

    monkeypatch.setattr(registry, "_client", Down)
    with pytest.raises(MlflowException, match="connection refused"):
        registry.champion("draftops-draft")

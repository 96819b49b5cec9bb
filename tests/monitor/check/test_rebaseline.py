"""`draftops monitor rebaseline`: only the operator's explicit command starts a server baseline afresh, and MLflow
records who asked and why."""
import json

import mlflow
import yaml
from mlflow import MlflowClient

from monitor.check.rebaseline import BY_TAG, REASON_TAG
from monitor.fleet.prometheus import state_path
from monitor.fleet.verdicts import read_fleet
from pipeline import metrics as M
from pipeline.cli import main
from pipeline.config import load_config
from tests.monitor.fleet.test_prometheus import NOW, B, Recorded

NAME = "draftops-draft"


def test_rebaseline_restarts_the_champions_baseline_and_records_who_and_why(tmp_path, mlflow_uri, capsys):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({
        "tracking": {"uri": mlflow_uri, "system_metrics": False},
        "monitor": {"state_dir": str(tmp_path / "state"), "prometheus_url": "http://prometheus.invalid:9090",
                    "engines": [{"replica": B}], "server_baseline_windows": 7, "server_recent_windows": 3}}))
    client = MlflowClient()
    client.create_registered_model(NAME)
    client.create_model_version(NAME, source="file:///nonexistent")
    client.set_registered_model_alias(NAME, M.CHAMPION, "1")
    cfg = load_config(str(path))
    read_fleet(cfg, "1", get=Recorded(), now=NOW)
    assert B in json.loads(state_path(cfg).read_text())["versions"]["1"]["baselines"]

    assert main(["monitor", "rebaseline", "--config", str(path), "--by", "alice", "--reason", " "]) == 2
    assert "needs --by NAME and --reason TEXT" in capsys.readouterr().err
    assert main(["monitor", "rebaseline", "--config", str(path), "--by", "alice",
                 "--reason", "fleet moved to new GPUs"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{NAME}@champion = version 1: server baseline restarted by alice (fleet moved to new GPUs)")
    assert json.loads(state_path(cfg).read_text())["versions"]["1"]["baselines"] == {}
    (run,) = mlflow.search_runs(experiment_names=["draftops-monitor"], output_format="list")
    assert run.data.tags[BY_TAG] == "alice" and run.data.tags[REASON_TAG] == "fleet moved to new GPUs"
    assert run.info.run_name == "rebaseline" and run.data.tags[M.MONITOR_CHAMPION_VERSION_TAG] == "1"

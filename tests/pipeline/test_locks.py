"""One lock per registered model, shared by every process that changes it, whatever its working directory."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from pipeline import metrics as M
from pipeline import registry
from pipeline.cli import main
from pipeline.locks import ModelBusy, lock_path, model_lock

REPO = Path(__file__).resolve().parents[2]
NAME = "draftops-draft"


def test_the_lock_path_follows_the_store_and_the_model_not_the_working_directory(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    here = lock_path(NAME, uri)
    monkeypatch.chdir(tmp_path)
    assert lock_path(NAME, uri) == here == tmp_path / "store" / ".draftops-locks" / f"{NAME}.lock"
    assert lock_path("other-model", uri) != here
    monkeypatch.setenv("DRAFTOPS_HOME", str(tmp_path / "home"))
    served = lock_path(NAME, "http://127.0.0.1:5000")
    assert served.is_relative_to(tmp_path / "home" / "locks") and served == lock_path(NAME, "http://127.0.0.1:5000")


def test_the_lock_is_reentrant_within_a_check(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    with model_lock(NAME, uri), model_lock(NAME, uri):  # a check that promotes: the same thread again
        pass


@pytest.fixture
def held_elsewhere(tmp_path, mlflow_uri):
    """The model's lock held by another process (a check running from another folder), and a config for this one."""
    client = MlflowClient()
    client.create_registered_model(NAME)
    for _ in range(2):
        client.create_model_version(NAME, source="file:///nonexistent")
    client.set_registered_model_alias(NAME, M.CHAMPION, "2")
    client.set_registered_model_alias(NAME, M.PREVIOUS_CHAMPION, "1")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pipeline.locks import model_lock\n"
         "with model_lock(sys.argv[1], sys.argv[2]):\n    print('held', flush=True); time.sleep(60)",
         NAME, mlflow_uri], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    config = tmp_path / "elsewhere.yaml"
    config.write_text(yaml.safe_dump({"tracking": {"uri": mlflow_uri, "system_metrics": False},
                                      "monitor": {"state_dir": str(tmp_path / "state")}}))
    yield config
    holder.kill()
    holder.wait()


def test_check_and_rollback_exit_75_while_another_process_holds_the_model(held_elsewhere, capsys):
    assert main(["monitor", "check", "--config", str(held_elsewhere)]) == 75
    assert main(["monitor", "rollback", "--config", str(held_elsewhere)]) == 75
    err = capsys.readouterr().err
    assert err.count(f"registered model '{NAME}' is busy") == 2 and "not rolling back" in err
    assert str(MlflowClient().get_model_version_by_alias(NAME, M.CHAMPION).version) == "2"  # untouched
    with pytest.raises(ModelBusy):
        registry.rollback(NAME)

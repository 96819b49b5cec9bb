"""The drift demo end to end on tiny models: OK -> DRIFT(target changed) -> retrain, promote -> OK."""
import pytest
import torch
import yaml
from mlflow import MlflowClient

from monitor.rehearsal.drift_demo import draftops_executable, run_demo
from pipeline.cli import main as draftops
from pipeline.sources import save_checkpoint
from tests.conftest import make_tiny_model, make_tokenizer
from tests.distill.tiny_job import tiny_config

NAME = "draftops-drift-demo"


def write_sharp_target(path):
    """The tiny target with 8x embeddings: its tied head gives peaked distributions (a flat 1/V one barely moves)."""
    tokenizer = make_tokenizer(extra_words=40)
    model = make_tiny_model(len(tokenizer), seed=0)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(8.0)
    save_checkpoint(model, tokenizer, path)


def demo_config(tmp_path, mlflow_uri, *overrides):
    write_sharp_target(tmp_path / "target")
    return tiny_config(
        tmp_path, f"tracking.uri={mlflow_uri}", f"tracking.registered_model={NAME}", "decode.max_new_tokens=12",
        "decode.gamma=3", "monitor.heldout_requests=64", "monitor.n_bootstrap=500", "monitor.break_even_alpha=0.0",
        "target_update.steps=12", "target_update.learning_rate=0.01", "target_update.lora_r=4",
        "target_update.lora_alpha=8", *overrides)


def test_demo_moves_the_champion_and_ends_with_the_recheck_command(tmp_path, mlflow_uri):
    lines = []
    out = tmp_path / "demo"
    result = run_demo(demo_config(tmp_path, mlflow_uri), out, echo=lines.append)
    assert result.decisions == ["OK", "DRIFT(target_changed)", "OK"]
    assert result.versions == ["1", "2"] and (result.champion_before, result.champion_after) == ("1", "2")
    client = MlflowClient()
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == "2"
    assert str(client.get_model_version_by_alias(NAME, "previous-champion").version) == "1"
    assert result.acceptance_drop > 0.05 and len(result.phases) == 5
    updated = out / "config-updated-target.yaml"
    assert lines[-1] == f"{draftops_executable()} monitor check --config {updated}"
    assert lines[-1].split()[0].endswith("draftops")
    written = yaml.safe_load(updated.read_text())
    assert written["target"] == str(out / "target-updated") and written["monitor"]["retrain"] is True
    assert (written["distill"]["init"] == "checkpoint"
            and written["distill"]["init_checkpoint"] == f"models:/{NAME}@champion")
    assert any(line.strip().endswith("total") for line in lines)

    # the printed command re-checks the state the demo left: OK, still version 2
    assert draftops(["monitor", "check", "--config", str(updated)]) == 0
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == "2"


def test_demo_refuses_the_production_model(tmp_path, mlflow_uri):
    with pytest.raises(ValueError, match="name of its own"):
        run_demo(demo_config(tmp_path, mlflow_uri, "tracking.registered_model=draftops-draft"), tmp_path / "demo")


def test_shipped_demo_config_fits_the_shipped_traffic():
    from pipeline.config import REPO_CONFIGS, load_config
    from pipeline.traffic import load_traffic

    cfg = load_config(REPO_CONFIGS / "drift_demo.yaml")
    assert cfg.tracking.registered_model not in ("", "draftops-draft")
    heldout = load_traffic(cfg.traffic.path).split("heldout", cfg.traffic.heldout_fraction)
    assert cfg.monitor.heldout_requests == len(heldout) >= 96  # every held-out request, enough for the tests
    assert cfg.target_update.prompts == "traffic" and cfg.monitor.break_even_alpha < 0.4


def test_demo_refuses_a_folder_it_did_not_create(tmp_path, mlflow_uri):
    """`--out .` in a checkout must not empty the source folders distill/ and monitor/."""
    out = tmp_path / "checkout"
    (out / "distill").mkdir(parents=True)
    (out / "distill" / "train.py").write_text("source code")
    with pytest.raises(ValueError, match="did not create"):
        run_demo(demo_config(tmp_path, mlflow_uri), out)
    assert (out / "distill" / "train.py").read_text() == "source code"


def test_demo_never_deletes_a_registered_model_it_did_not_create(tmp_path, mlflow_uri):
    client = MlflowClient()
    client.create_registered_model(NAME)
    client.create_model_version(NAME, source="file:///nonexistent")
    with pytest.raises(ValueError, match="not created by the drift demo"):
        run_demo(demo_config(tmp_path, mlflow_uri), tmp_path / "demo")
    assert [v.version for v in client.search_model_versions(f"name='{NAME}'")] in (["1"], [1])

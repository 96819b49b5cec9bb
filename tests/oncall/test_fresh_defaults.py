"""The monitor's defaults on a fresh home, on tiny models: no `draftops bench` has run (no measured costs, so no
break-even), and `draftops monitor check` twice is OK twice, for a draft whose acceptance is below any constant
break-even one might have picked (a fresh `make distill` draft is ~0.34)."""
import json
import os

import mlflow
import pytest
import yaml
from mlflow import MlflowClient

from monitor.check.run import load_models
from pipeline import metrics as M
from pipeline import registry
from pipeline.cli import main
from pipeline.config import load_config
from pipeline.sources import save_checkpoint
from tests.conftest import WORDS, make_tiny_model, make_tokenizer

NAME = "draftops-draft"


def _traffic(path, count: int = 60) -> None:
    with open(path, "w") as f:
        for i in range(count):
            words = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(3 + i % 5))
            f.write(json.dumps({"id": f"q{i}", "ts": f"2026-10-01T00:{i:02d}:00Z",
                                "messages": [{"role": "user", "content": words}]}) + "\n")


def _sharpened_copy(tokenizer, sharpness: float):
    """The target's own weights with its logits multiplied by `sharpness` (the final norm's scale): at temperature 1
    the draft puts its mass on the target's likeliest tokens, so the two agree on only part of each distribution."""
    import torch

    draft = make_tiny_model(len(tokenizer), seed=0)
    with torch.no_grad():
        draft.model.norm.weight.mul_(sharpness)
    return draft


def test_a_fresh_home_without_a_bench_checks_ok_twice(tmp_path, mlflow_uri, capsys):
    home = os.environ["DRAFTOPS_HOME"]  # the test's own, empty: no bench, no measured costs, no cached responses
    assert not os.path.exists(home) or not os.listdir(home)
    tokenizer = make_tokenizer()
    target = save_checkpoint(make_tiny_model(len(tokenizer), seed=0), tokenizer, tmp_path / "target")
    draft = save_checkpoint(_sharpened_copy(tokenizer, 8.0), tokenizer, tmp_path / "draft")
    traffic = tmp_path / "traffic.jsonl"
    _traffic(traffic)
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump({  # monitor.* left at its defaults, break_even_alpha included
        "target": str(target), "device": "cpu", "cpu_linear": "torch",
        "traffic": {"path": str(traffic), "heldout_fraction": 0.5},
        "tracking": {"uri": mlflow_uri, "system_metrics": False},
        # temperature 1: greedy argmax of random tied-embedding models mostly repeats the input token
        "decode": {"max_new_tokens": 6, "gamma": 3, "temperature": 1.0},
        "distill": {"generation_batch_size": 16}}))
    cfg = load_config(cfg_path)
    assert cfg.monitor.break_even_alpha is None
    loaded, _ = load_models(cfg, str(target))
    mlflow.set_experiment("draftops-distill")
    with mlflow.start_run():  # what `make distill` leaves: a champion, and no bench run on it
        version, alias = registry.register(draft, NAME, tags={M.TARGET_FINGERPRINT_TAG: loaded.fingerprint},
                                           description="tiny test draft")
    assert (str(version.version), alias) == ("1", M.CHAMPION)
    assert M.LATEST_BENCH_RUN_TAG not in MlflowClient().get_model_version(NAME, "1").tags

    reports = []
    for _ in range(2):
        assert main(["monitor", "check", "--config", str(cfg_path), "--json"]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    assert [r["status"] for r in reports] == ["OK", "OK"]
    first, second = reports
    assert first["baseline_recorded"] and not second["baseline_recorded"]
    assert 0.05 < second["current_acceptance"] < 0.4  # below the break-even constant the defaults once had
    assert all(r["break_even"] is None for r in reports)
    assert all(r["break_even_source"].startswith("none: no `draftops bench`") for r in reports)
    assert second["acceptance"]["paired"]["drop"] == pytest.approx(0.0, abs=1e-6)
    decisions = [run.data.tags["draftops.monitor.decision"] for run in MlflowClient().search_runs(
        [mlflow.get_experiment_by_name("draftops-monitor").experiment_id])]
    assert decisions == ["OK", "OK"]

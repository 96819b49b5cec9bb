"""The real check path on tiny models: registry resolution, cached target responses, analytic and live acceptance."""
import json

import mlflow
import pytest
import yaml

from monitor.check.decision import Cause, Status
from monitor.check.prompt_acceptance import measure_analytic, measure_live
from monitor.check.run import load_models, run_check
from pipeline import metrics as M
from pipeline import registry
from pipeline.config import load_config
from pipeline.sources import save_checkpoint
from pipeline.traffic import heldout_by_recency
from tests.conftest import WORDS, make_tiny_model, make_tokenizer

NAME = "draftops-draft"


def write_word_traffic(path, n: int):
    """`n` requests of 3-7 words of the tiny tokenizer's vocabulary, a minute apart."""
    with open(path, "w") as f:
        for i in range(n):
            words = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(3 + i % 5))
            f.write(json.dumps({"id": f"q{i}", "ts": f"2026-10-01T00:{i:02d}:00Z",
                                "messages": [{"role": "user", "content": words}]}) + "\n")
    return path


@pytest.fixture
def world(tmp_path, mlflow_uri):
    tokenizer = make_tokenizer()
    target_a = save_checkpoint(make_tiny_model(len(tokenizer), seed=0), tokenizer, tmp_path / "target_a")
    target_b = save_checkpoint(make_tiny_model(len(tokenizer), seed=1), tokenizer, tmp_path / "target_b")
    traffic = write_word_traffic(tmp_path / "traffic.jsonl", 60)

    def config(target, *overrides):
        path = tmp_path / "cfg.yaml"
        path.write_text(yaml.safe_dump({
            "target": str(target), "device": "cpu",
            "traffic": {"path": str(traffic), "heldout_fraction": 0.5},
            "tracking": {"uri": mlflow_uri, "system_metrics": False},
            # temperature 1: greedy argmax of random tied-embedding models mostly repeats the input token, so
            # two different random models agree under greedy decoding; their sampling distributions do not
            "decode": {"max_new_tokens": 6, "gamma": 3, "temperature": 1.0},
            "distill": {"generation_batch_size": 16},
            "monitor": {"heldout_requests": 12, "state_dir": str(tmp_path / "state"), "n_bootstrap": 500,
                        "break_even_alpha": 0.0},
        }))
        return load_config(path, overrides), path

    return target_a, target_b, config


def register_draft(cfg, checkpoint, fingerprint):
    mlflow.set_experiment("draftops-distill")  # fluent mlflow remembers the experiment id of an earlier test's store
    with mlflow.start_run():
        version, alias = registry.register(checkpoint, NAME, tags={M.TARGET_FINGERPRINT_TAG: fingerprint},
                                           description="test draft")
    return str(version.version), alias


def test_identical_draft_has_acceptance_one(world):
    target_a, _, config = world
    cfg, _ = config(target_a)
    target, draft = load_models(cfg, str(target_a))
    requests = heldout_by_recency(cfg.traffic)[-5:]
    analytic = measure_analytic(cfg, target, draft, requests)
    assert analytic.request_ids == [r.id for r in requests]
    assert analytic.acc == pytest.approx(analytic.n) and all(n >= 1 for n in analytic.n)
    assert sum(analytic.token_counts.values()) > 0
    live = measure_live(cfg, target, draft, requests)
    assert live.acc == live.n and live.acceptance == 1.0


def test_target_update_is_detected_end_to_end(world, capsys):
    from pipeline.cli import main

    target_a, target_b, config = world
    cfg, cfg_path = config(target_a)
    target, _ = load_models(cfg, str(target_a))
    version, alias = register_draft(cfg, target_a, target.fingerprint)  # a draft equal to its target: alpha = 1
    assert (version, alias) == ("1", M.CHAMPION)

    first = run_check(cfg)
    assert first.baseline_recorded and first.current_acceptance == pytest.approx(1.0)
    assert main(["monitor", "check", "--config", str(cfg_path), "--json"]) == 0
    ok = json.loads(capsys.readouterr().out)
    assert ok["status"] == "OK" and ok["acceptance"]["paired"]["drop"] == pytest.approx(0.0, abs=1e-6)

    # the target is updated (other weights): the champion no longer fits it
    assert main(["monitor", "check", "--config", str(cfg_path), f"target={target_b}", "--json"]) == 3
    drift = json.loads(capsys.readouterr().out)
    assert drift["status"] == "DRIFT" and drift["cause"] == Cause.TARGET_CHANGED.value
    assert drift["target_fingerprint"] != drift["champion_target_fingerprint"] == target.fingerprint
    assert drift["acceptance"]["paired"]["alarm"] and drift["acceptance"]["paired"]["drop"] > 0.05
    report = run_check(config(target_b)[0])
    assert report.decision.status is Status.DRIFT

"""The check's orchestration, promotion gate and rollback, with fake models on a temporary sqlite MLflow store."""
import hashlib
import json
from dataclasses import dataclass

import mlflow
import numpy as np
import pytest
import yaml
from mlflow import MlflowClient

from monitor.check.decision import Cause, Status, challenger_gate
from monitor.check.prompt_acceptance import Baseline, Measurement
from monitor.check.run import rollback, run_check, scheduled_check
from monitor.stats.acceptance_tests import PromptAcceptance
from pipeline import metrics as M
from pipeline import registry
from pipeline.config import load_config

NAME = "draftops-draft"


@dataclass
class FakeModel:
    fingerprint: str = ""
    version: str = ""


class World:
    """What the fakes read: the current target, and each draft version's quality relative to the first champion."""

    def __init__(self):
        self.target_fingerprint = "fp-A"
        self.quality = {"1": 0.0}  # acceptance offset per draft version
        self.target_penalty = {"fp-A": 0.0}  # acceptance lost by every draft on this target
        self.measured = []

    def load(self, cfg, draft_source, target=None):
        return FakeModel(fingerprint=self.target_fingerprint), FakeModel(version=draft_source.rsplit("/", 1)[1])

    def measure(self, cfg, target, draft, requests):
        self.measured.append((draft.version, len(requests)))
        rates, counts = [], {}
        for r in requests:
            h = int(hashlib.sha256(r.id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
            code = r.category == "code"
            rate = 0.55 + 0.3 * h + self.quality[draft.version] - self.target_penalty[target.fingerprint]
            rates.append(min(max(rate - (0.15 if code else 0.0), 0.0), 1.0))
            for t in range(100, 140) if code else range(1, 41):
                counts[t] = counts.get(t, 0) + 1
        return Measurement([r.id for r in requests], [64 * a for a in rates], [64.0] * len(requests), counts)

    def retrain_with(self, quality):
        def retrain(cfg):
            client = MlflowClient()
            version = str(client.create_model_version(NAME, source="file:///nonexistent", tags={
                M.TARGET_FINGERPRINT_TAG: self.target_fingerprint}).version)
            client.set_registered_model_alias(NAME, M.CHALLENGER, version)
            self.quality[version] = quality
            return version
        return retrain


def write_traffic(path, start, count, category="chat"):
    with open(path, "a") as f:
        for i in range(start, start + count):
            f.write(json.dumps({"id": f"req-{i:05d}", "category": category,
                                "ts": f"2026-10-01T{i // 60:02d}:{i % 60:02d}:00Z",
                                "messages": [{"role": "user", "content": f"question {i}"}]}) + "\n")


def check_world(tmp_path, mlflow_uri, **monitor):
    """A config over 120 requests of traffic (`monitor` keys on top of the check's), version 1 of NAME registered as
    champion, and the fake models: (cfg, World(), the traffic file)."""
    traffic = tmp_path / "traffic.jsonl"
    write_traffic(traffic, 0, 120)
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "traffic": {"path": str(traffic), "heldout_fraction": 0.5},
        "tracking": {"uri": mlflow_uri, "system_metrics": False},
        "monitor": {"heldout_requests": 30, "state_dir": str(tmp_path / "state"), "n_bootstrap": 500, **monitor},
    }))
    cfg = load_config(cfg_path)
    client = MlflowClient()
    client.create_registered_model(NAME)
    client.create_model_version(NAME, source="file:///nonexistent", tags={M.TARGET_FINGERPRINT_TAG: "fp-A"})
    client.set_registered_model_alias(NAME, M.CHAMPION, "1")
    return cfg, World(), traffic


@pytest.fixture
def setup(tmp_path, mlflow_uri):
    return check_world(tmp_path, mlflow_uri)


def check(cfg, world, **kw):
    return run_check(cfg, load=world.load, measure=world.measure, **kw)


def champion_version():
    return str(MlflowClient().get_model_version_by_alias(NAME, M.CHAMPION).version)


def test_first_check_records_baseline_then_ok(setup):
    cfg, world, _ = setup
    first = check(cfg, world)
    assert first.baseline_recorded and first.decision.status is Status.OK and first.exit_code == 0
    assert first.n_baseline_prompts == 30
    stored = Baseline.from_dict(registry.load_baseline(MlflowClient().get_model_version(NAME, "1")))
    assert stored.target_fingerprint == "fp-A" and len(stored.measurement.request_ids) == 30

    second = check(cfg, world)
    assert second.decision.status is Status.OK and not second.baseline_recorded
    assert second.acceptance.paired.drop == pytest.approx(0.0) and not second.acceptance.alarm
    assert second.acceptance.unpaired is None  # no held-out request the baseline has not seen
    run = MlflowClient().get_run(second.run_id)
    assert run.data.tags["draftops.monitor.decision"] == "OK"
    assert run.data.metrics["monitor/paired/drop"] == run.data.metrics["monitor/drop"] == pytest.approx(0.0)
    assert run.data.metrics["monitor/acceptance_now"] == pytest.approx(second.current_acceptance)
    assert run.data.metrics["monitor/acceptance_threshold"] == pytest.approx(
        second.acceptance.paired.baseline_acceptance - cfg.monitor.margin)
    assert mlflow.get_experiment(run.info.experiment_id).name == "draftops-monitor"
    assert "monitor/history.png" in {a.path for a in MlflowClient().list_artifacts(run.info.run_id, "monitor")}


def test_target_change_drifts_and_worse_challenger_is_never_promoted(setup):
    cfg, world, _ = setup
    check(cfg, world)
    world.target_fingerprint = "fp-B"
    world.target_penalty["fp-B"] = 0.08
    cfg = cfg.model_copy(update={"monitor": cfg.monitor.model_copy(update={"retrain": True})})
    report = check(cfg, world, retrain=world.retrain_with(quality=-0.1))  # challenger even worse
    assert report.decision.status is Status.DRIFT and report.decision.cause is Cause.TARGET_CHANGED
    assert report.exit_code == 3
    assert report.acceptance.paired.drop == pytest.approx(0.08)
    assert report.retrain.challenger_version == "2" and not report.retrain.promoted
    assert report.retrain.gate.drop == pytest.approx(-0.1)
    assert champion_version() == "1"
    assert MlflowClient().get_run(report.run_id).data.tags["draftops.monitor.promoted"] == "false"

    # a challenger better by less than promote_margin is not promoted either
    report = check(cfg, world, retrain=world.retrain_with(quality=0.005))
    assert not report.retrain.promoted and champion_version() == "1"

    def failing_retrain(cfg):
        raise RuntimeError("distillation diverged")

    report = check(cfg, world, retrain=failing_retrain)  # a failed retrain leaves the DRIFT standing
    assert report.exit_code == 3 and report.retrain is None and champion_version() == "1"
    assert "retraining failed: RuntimeError: distillation diverged" in report.decision.notes


def test_better_challenger_is_promoted_with_its_baseline_and_rollback_restores(setup):
    cfg, world, _ = setup
    check(cfg, world)
    world.target_fingerprint = "fp-B"
    world.target_penalty["fp-B"] = 0.08
    cfg = cfg.model_copy(update={"monitor": cfg.monitor.model_copy(update={"retrain": True})})
    report = check(cfg, world, retrain=world.retrain_with(quality=0.1))
    assert report.retrain.promoted and report.retrain.previous_champion == "1"
    assert report.retrain.gate.drop == pytest.approx(0.1)
    assert champion_version() == "2"
    client = MlflowClient()
    assert str(client.get_model_version_by_alias(NAME, M.PREVIOUS_CHAMPION).version) == "1"
    assert registry.load_baseline(client.get_model_version(NAME, "2"))["target_fingerprint"] == "fp-B"
    assert check(cfg, world).decision.status is Status.OK  # the new champion is judged against its own baseline

    assert rollback(cfg) == "1"
    assert champion_version() == "1"
    assert str(client.get_model_version_by_alias(NAME, M.PREVIOUS_CHAMPION).version) == "2"
    assert "draftops.monitor.rolled_back_at" in client.get_model_version(NAME, "2").tags
    assert rollback(cfg, to_version="2") == "2" and champion_version() == "2"


def test_traffic_shift_is_attributed_to_traffic(setup):
    cfg, world, traffic = setup
    check(cfg, world)
    write_traffic(traffic, 1000, 120, category="code")  # newer requests, other tokens, harder for the draft
    report = check(cfg, world)
    assert report.decision.status is Status.DRIFT and report.decision.cause is Cause.TRAFFIC_SHIFTED
    assert not report.acceptance.paired.alarm and report.acceptance.unpaired.alarm
    assert report.drift.drifted and report.drift.js_divergence > 0.5
    assert report.n_recent_prompts == 30


def test_no_champion_is_an_error_exit(setup, tmp_path):
    cfg, _, _ = setup
    MlflowClient().delete_registered_model_alias(NAME, M.CHAMPION)
    assert scheduled_check(cfg) == 2
    with pytest.raises(registry.RegistryError):
        rollback(cfg)


def test_challenger_gate_on_random_prompts():
    rng = np.random.default_rng(0)
    n = rng.integers(32, 128, 200).astype(float)
    alpha = rng.beta(6, 3, 200)
    champion = PromptAcceptance.of(rng.binomial(n.astype(int), alpha), n)
    better = PromptAcceptance.of(rng.binomial(n.astype(int), np.clip(alpha + 0.05, 0, 1)), n)
    worse = PromptAcceptance.of(rng.binomial(n.astype(int), np.clip(alpha - 0.05, 0, 1)), n)
    assert challenger_gate(champion, better, 0.01, 0.05).alarm
    assert not challenger_gate(champion, worse, 0.01, 0.05).alarm
    assert not challenger_gate(champion, champion, 0.0, 0.05).alarm


def test_cli_rollback_and_check_without_champion(setup, tmp_path, capsys):
    from pipeline.cli import main

    cfg, _, _ = setup
    cfg_path = tmp_path / "cfg.yaml"
    client = MlflowClient()
    client.create_model_version(NAME, source="file:///nonexistent")
    registry.promote(NAME, "2")
    assert main(["monitor", "rollback", "--config", str(cfg_path)]) == 0
    assert "version 1" in capsys.readouterr().out and champion_version() == "1"
    client.delete_registered_model_alias(NAME, M.CHAMPION)
    assert main(["monitor", "check", "--config", str(cfg_path)]) == 2
    assert "no 'champion' alias" in capsys.readouterr().err


def test_fewer_heldout_requests_than_configured_uses_all_and_notes_it(setup):
    cfg, world, _ = setup
    cfg.monitor.heldout_requests = 500  # the traffic holds ~60 held-out requests
    first = check(cfg, world)
    heldout = first.n_baseline_prompts
    assert first.decision.status is Status.OK and 40 < heldout < 80
    assert any(f"holds {heldout} held-out requests, fewer than monitor.heldout_requests=500" in n
               for n in first.decision.notes)
    second = check(cfg, world)
    assert second.acceptance.paired.n_current_prompts == heldout and second.decision.status is Status.OK
    cfg.monitor.heldout_requests = heldout
    assert not any("fewer than" in n for n in check(cfg, world).decision.notes)


def test_bad_config_is_a_clear_error_and_leaves_the_registry_alone(setup, tmp_path, capsys):
    """An unknown target source: exit 2 with the reason; aliases and versions untouched."""
    from pipeline.cli import main

    cfg, _, _ = setup
    before = {v.version: dict(v.aliases or []) for v in MlflowClient().search_model_versions(f"name='{NAME}'")}
    cfg_path = tmp_path / "cfg.yaml"
    assert main(["monitor", "check", "--config", str(cfg_path), "target=/nonexistent/model.gguf"]) == 2
    assert "GGUF file not found" in capsys.readouterr().err
    after = {v.version: dict(v.aliases or []) for v in MlflowClient().search_model_versions(f"name='{NAME}'")}
    assert after == before and champion_version() == "1"


def test_empty_heldout_split_is_a_clear_error_before_any_model_loads(setup, tmp_path):
    from pipeline.traffic import TrafficError

    cfg, world, _ = setup
    tiny = tmp_path / "tiny.jsonl"
    write_traffic(tiny, 0, 2)
    cfg.traffic.path, cfg.traffic.heldout_fraction = str(tiny), 0.001
    world.load = lambda *a, **k: pytest.fail("models loaded before the traffic was checked")
    with pytest.raises(TrafficError, match="held-out split is empty"):
        check(cfg, world)
    assert champion_version() == "1" and registry.load_baseline(registry.champion(NAME)) is None


def test_the_champions_measured_break_even_is_the_absolute_alarm(setup):
    cfg, world, _ = setup
    first = check(cfg, world)  # records the baseline; no bench run and none configured: no break-even
    assert first.decision.status is Status.OK and first.break_even is None
    assert first.break_even_source.startswith("none: no `draftops bench` of this version (make bench)")
    assert "break-even: none: no `draftops bench`" in first.summary()
    with mlflow.start_run() as run:  # what `draftops bench` leaves on the version it measured
        mlflow.log_metric(M.BREAK_EVEN_ALPHA, 0.95)
    MlflowClient().set_model_version_tag(NAME, "1", M.LATEST_BENCH_RUN_TAG, run.info.run_id)
    second = check(cfg, world)
    assert second.break_even == pytest.approx(0.95) and second.break_even_source == f"bench run {run.info.run_id}"
    assert second.decision.status is Status.DRIFT and second.exit_code != 0
    assert any("below break-even 0.950" in reason for reason in second.decision.reasons)


def test_a_fresh_draft_below_any_constant_break_even_is_ok_twice_without_a_bench(setup):
    """The defaults never page for want of a benchmark: a champion whose acceptance (~0.35) is what a fresh
    `make distill` gives is OK at its first check (the baseline) and at the next one."""
    cfg, world, _ = setup
    world.quality["1"] = -0.35
    reports = [check(cfg, world), check(cfg, world)]
    assert [r.decision.status for r in reports] == [Status.OK, Status.OK]
    assert reports[1].current_acceptance < 0.4 and reports[1].break_even is None
    assert not any("break-even" in reason for r in reports for reason in r.decision.reasons)


def test_a_nan_measurement_fails_closed_and_is_logged_as_an_error(setup):
    """A champion whose acceptance is NaN (NaN weights, an overflow): exit 2, an ERROR run, no baseline recorded."""
    cfg, world, _ = setup

    def nan_measure(cfg, target, draft, requests):
        good = world.measure(cfg, target, draft, requests)
        return Measurement(good.request_ids, [float("nan")] * len(good.acc), good.n, good.token_counts)

    first = run_check(cfg, load=world.load, measure=nan_measure)
    assert first.decision.status is Status.ERROR and first.exit_code == 2 and not first.baseline_recorded
    assert registry.load_baseline(MlflowClient().get_model_version(NAME, "1")) is None
    check(cfg, world)  # a real baseline
    later = run_check(cfg, load=world.load, measure=nan_measure)
    assert later.decision.status is Status.ERROR and later.exit_code == 2
    run = MlflowClient().get_run(later.run_id)
    assert run.data.tags["draftops.monitor.decision"] == "ERROR" and run.data.metrics["monitor/error"] == 1.0
    assert "nan" in " ".join(later.decision.reasons)


def test_a_failure_before_the_baseline_is_stored_leaves_the_old_champion(setup, monkeypatch):
    """Promotion is the last step: a champion never serves without a baseline (the next check would record a fresh
    one and say OK)."""
    cfg, world, _ = setup
    check(cfg, world)
    world.target_fingerprint = "fp-B"
    world.target_penalty["fp-B"] = 0.08
    cfg = cfg.model_copy(update={"monitor": cfg.monitor.model_copy(update={"retrain": True})})

    def fail(name, version, payload):
        raise RuntimeError("killed while storing the baseline")

    monkeypatch.setattr(registry, "save_baseline", fail)
    with pytest.raises(RuntimeError, match="killed"):
        check(cfg, world, retrain=world.retrain_with(quality=0.1))
    assert champion_version() == "1"
    assert registry.load_baseline(MlflowClient().get_model_version(NAME, "1"))["target_fingerprint"] == "fp-A"


def test_a_challenger_starts_warm_from_the_champion_by_default():
    from monitor.check.retrain import challenger_config

    cfg = load_config(None, ["tracking.registered_model=drafts", "distill.register_model=false"])
    warm = challenger_config(cfg).distill
    assert (warm.init, warm.init_checkpoint, warm.register_model) == ("checkpoint", "models:/drafts@champion", True)
    cold = challenger_config(load_config(None, ["monitor.retrain_init=config"])).distill
    assert (cold.init, cold.register_model) == ("config", True)  # the default job's own start: a random feature layer
    cold = challenger_config(load_config(None, ["monitor.retrain_init=config", "distill.family=layers"])).distill
    assert (cold.init, cold.init_layers, cold.register_model) == ("target_layers", [0, 1], True)

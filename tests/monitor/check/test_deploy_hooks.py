"""The post-deploy check: the engine's acceptance (counters of a fake llama-server on 127.0.0.1) against the deployed
draft's offline figure as an engine counts it; DEPLOY_MISMATCH, its exit code and the rollback of the deployment; the
statistics it rests on (engine rounds by hand, the test's false-alarm rate)."""
import os
import random

import numpy as np
import pytest
from mlflow import MlflowClient

from monitor.check.decision import Cause, Status
from monitor.check.prompt_acceptance import Measurement
from monitor.check.run import run_check
from monitor.fleet.offline_expectation import engine_rounds, engine_vs_offline_test
from monitor.release.layout import CURRENT, MISMATCH, VERIFIED, DeployFolder
from pipeline import metrics as M
from pipeline.config import load_config
from tests.monitor.check.test_run import World, write_traffic
from tests.monitor.deploy_world import (
    calls_of,
    recorder,
    register_tiny_draft,
    start_engine,
    stop_engine,
    write_config,
)

ENGINE_SHARE = 0.75  # the fake's engine figure per prompt: 75% of its analytic acceptance


def test_engine_rounds_by_hand():
    # γ=3: the target gives token 0; round 1 drafts 1-3, accepts 1, rejects 2; round 2 drafts 3-5, all accepted
    assert engine_rounds([1, 1, 0, 1, 1, 1, 1], 3, 64) == (4.0, 6.0)
    assert engine_rounds([1, 1, 1, 1], 3, 64) == (3.0, 3.0)  # the stop token (last) accepted: done
    assert engine_rounds([1, 1, 1], 3, 64) == (2.0, 3.0)  # a draft past the stop token is never accepted
    assert engine_rounds([1] * 6, 3, 6) == (3.0, 3.0)  # then no room to draft (max_new_tokens): the target's step
    assert engine_rounds([1], 3, 64) == (0.0, 0.0)
    # fractional α: the expectation over rounds, as the mean of greedy replays with positions drawn at α
    alphas = [0.9, 0.5, 0.7, 0.2, 0.8, 0.6, 1.0, 0.3, 0.9, 0.4]
    rng = random.Random(0)
    draws = [engine_rounds([float(rng.random() < a) for a in alphas], 4, 64) for _ in range(20000)]
    accepted, drafted = engine_rounds(alphas, 4, 64)
    assert accepted == pytest.approx(np.mean([a for a, _ in draws]), abs=0.03)
    assert drafted == pytest.approx(np.mean([d for _, d in draws]), abs=0.03)


def _prompts(rng, n, shift=0.0):
    tokens = rng.integers(40, 80, n)
    return rng.binomial(tokens, np.clip(rng.beta(6, 4, n) - shift, 0, 1)).astype(float), tokens.astype(float)


def test_engine_vs_offline_false_alarms_at_the_level_and_sees_a_wrong_draft():
    rng = np.random.default_rng(7)
    alarms, power = 0, 0
    for _ in range(1500):
        offline = _prompts(rng, 60)
        windows = [tuple(x.sum() for x in _prompts(rng, 8)) for _ in range(3)]
        alarms += engine_vs_offline_test(*offline, *zip(*windows), tolerance=0.0, level=0.05).alarm
        worse = [tuple(x.sum() for x in _prompts(rng, 8, shift=0.3)) for _ in range(3)]  # a draft that keeps half
        power += engine_vs_offline_test(*offline, *zip(*worse), tolerance=0.25, level=0.05).alarm
    assert 0.02 <= alarms / 1500 <= 0.08  # Welch's t keeps the level with 3 windows
    assert power / 1500 > 0.85  # a wrong draft (half the acceptance) from 3 windows of 8 prompts each
    with pytest.raises(ValueError, match="2 engine windows"):
        engine_vs_offline_test([1, 2], [5, 5], [1], [5], 0.0, 0.05)


class EngineWorld(World):
    """The fake models of test_monitor_check, whose measurements also carry the figure an engine counts."""

    def measure(self, cfg, target, draft, requests):
        m = super().measure(cfg, target, draft, requests)
        return Measurement(m.request_ids, m.acc, m.n, m.token_counts, [a * ENGINE_SHARE for a in m.acc], list(m.n))

    def retrain_tiny(self, root, quality):
        def retrain(cfg):
            version = register_tiny_draft(root, seed=10 + len(self.quality), fingerprint=self.target_fingerprint)
            self.quality[version] = quality
            return version
        return retrain


@pytest.fixture
def loop(tmp_path, mlflow_uri):
    traffic = tmp_path / "traffic.jsonl"
    write_traffic(traffic, 0, 120)
    assert register_tiny_draft(tmp_path, seed=1) == "1"
    engine = start_engine(acceptance=0.52)
    url = f"http://127.0.0.1:{engine.server_port}/metrics"
    cfg = load_config(write_config(tmp_path, mlflow_uri, traffic, check_windows=3, check_window_seconds=0.01,
                                   rollback_on_mismatch=True), [f"monitor.server_metrics_url={url}"])
    yield cfg, EngineWorld(), engine, tmp_path
    stop_engine(engine)


def check(cfg, world, **kw):
    return run_check(cfg, load=world.load, measure=world.measure, wait=lambda seconds: None, **kw)


def test_post_deploy_check_confirms_then_catches_an_engine_without_the_new_draft(loop):
    cfg, world, engine, root = loop
    deploy_root, (_, calls) = root / "deploy", recorder(root)

    first = check(cfg, world)  # deploys version 1, records its baseline, reads the engine: confirmed
    assert first.decision.status is Status.OK and [r.action for r in first.deploys] == ["deploy"]
    assert first.engine.post_deploy and len(first.engine.windows) == 3 and not first.engine.mismatch
    assert first.engine.expected == pytest.approx(first.current_acceptance * ENGINE_SHARE)
    assert DeployFolder(deploy_root).read_state()["check"] == VERIFIED
    assert check(cfg, world).engine is None  # verified: later checks read no windows (engine_check: after_deploy)

    # the target changes; the engine's acceptance with the old draft falls; retraining promotes version 2
    world.target_fingerprint, world.target_penalty["fp-B"] = "fp-B", 0.3
    engine.acceptance = 0.30
    retrain_cfg = cfg.model_copy(update={"monitor": cfg.monitor.model_copy(update={"retrain": True})})
    drift = check(retrain_cfg, world, retrain=world.retrain_tiny(root, quality=0.3))
    assert drift.decision.status is Status.DRIFT and drift.retrain.promoted
    assert [(r.action, r.deployment.version) for r in drift.deploys] == [("deploy", "2")]
    assert os.readlink(deploy_root / CURRENT) == "versions/v2" and calls_of(calls)[-1][0] == "2"

    # the engine still serves the old draft (its reload did not take): the post-deploy check catches it
    mismatch = check(cfg, world)
    assert mismatch.decision.status is Status.DEPLOY_MISMATCH and mismatch.exit_code == 4
    assert mismatch.engine.mismatch and mismatch.engine.test.drop > mismatch.engine.test.margin > 0.1
    assert mismatch.decision.reasons[0].startswith("post-deploy check: the engine's acceptance 0.28")
    assert mismatch.engine.pre_drift.alarm and mismatch.engine.recovered is False
    assert [(r.action, r.deployment.version) for r in mismatch.deploys] == [("rollback", "1")]
    assert os.readlink(deploy_root / CURRENT) == "versions/v1" and calls_of(calls)[-1][0] == "1"
    state = DeployFolder(deploy_root).read_state()
    assert state["failed_version"] == "2" and state["check"] == "rolled_back"
    run = MlflowClient().get_run(mismatch.run_id)
    assert run.data.tags[M.MONITOR_DECISION_TAG] == "DEPLOY_MISMATCH"
    assert run.data.metrics[M.MONITOR_DEPLOY_MISMATCH] == 1.0 and run.data.metrics[M.ENGINE_MISMATCH] == 1.0
    assert run.data.metrics[M.ENGINE_ACCEPTANCE] == pytest.approx(mismatch.engine.acceptance)
    assert "DEPLOY_MISMATCH" in mismatch.summary() and "NOT what the engine runs" in mismatch.summary()

    after = check(cfg, world)  # the failed version is not deployed again by itself
    assert DeployFolder(deploy_root).linked(CURRENT).version == "1"
    assert "version 2 failed its post-deploy check" in after.summary()

    # fixed by hand: deployed again, and the engine now shows the new draft's acceptance: confirmed and recovered
    from pipeline.cli import main
    assert main(["monitor", "deploy", "--config", str(root / "cfg.yaml"), "--force"]) == 0
    engine.acceptance = 0.52
    recovered = check(cfg, world)
    assert recovered.decision.status is Status.OK and recovered.engine.post_deploy
    assert not recovered.engine.mismatch and recovered.engine.recovered is True
    assert DeployFolder(deploy_root).read_state()["check"] == VERIFIED


def test_engine_check_always_sees_the_drop_in_the_servers_counters(loop):
    cfg, world, engine, root = loop
    deploy = cfg.monitor.deploy.model_copy(update={"engine_check": "always", "enabled": False})
    cfg = cfg.model_copy(update={"monitor": cfg.monitor.model_copy(update={"deploy": deploy})})
    assert check(cfg, world).decision.status is Status.OK
    engine.acceptance = 0.25  # only the engine sees it: the offline measurement is unchanged
    report = check(cfg, world)
    assert report.decision.status is Status.DRIFT and report.decision.cause is Cause.SERVER_ACCEPTANCE_DROPPED
    assert not report.engine.post_deploy and not report.acceptance.alarm
    assert "recent vs the champion's offline figure on 30 prompts" in report.decision.reasons[0]
    assert not (root / "deploy").exists()
    assert DeployFolder(root / "deploy").read_state() == {} and MISMATCH == "mismatch"


def test_a_check_whose_deploy_fails_is_deploy_failed_never_ok(loop):
    cfg, world, engine, root = loop
    deploy_root = root / "deploy"
    deploy_root.mkdir()
    (deploy_root / CURRENT).mkdir()  # a folder put there by hand: the deploy before the check is refused
    failed = check(cfg, world)
    assert failed.decision.status is Status.DEPLOY_FAILED and failed.exit_code == 5
    assert failed.decision.reasons[0].startswith(f"deploy of the champion failed: {deploy_root / CURRENT} is a folder")
    assert failed.baseline_recorded  # the check itself still ran and is recorded
    run = MlflowClient().get_run(failed.run_id)
    assert run.data.tags[M.MONITOR_DECISION_TAG] == "DEPLOY_FAILED" and run.data.metrics[M.MONITOR_DEPLOY_FAILED] == 1
    assert failed.summary().startswith("DEPLOY_FAILED: ")

    # a promoted challenger whose deploy fails after the check's run is logged: the run is tagged again
    (deploy_root / CURRENT).rmdir()
    assert check(cfg, world).decision.status is Status.OK  # version 1 deployed and confirmed
    world.target_fingerprint, world.target_penalty["fp-B"] = "fp-B", 0.3
    engine.acceptance = 0.30
    (root / "reloads.txt.fail").write_text("")  # the engine refuses the reload of version 2
    retrain_cfg = cfg.model_copy(update={"monitor": cfg.monitor.model_copy(update={"retrain": True})})
    drift = check(retrain_cfg, world, retrain=world.retrain_tiny(root, quality=0.3))
    assert drift.retrain.promoted and drift.decision.status is Status.DEPLOY_FAILED and drift.exit_code == 5
    assert "deploy of the new champion failed: deploy step reload" in drift.decision.reasons[0]
    assert drift.decision.notes[0].startswith("also DRIFT (target_changed): ")
    run = MlflowClient().get_run(drift.run_id)
    assert run.data.tags[M.MONITOR_DECISION_TAG] == "DEPLOY_FAILED"
    assert run.data.tags["mlflow.runName"] == "check-deploy_failed"
    assert run.data.metrics[M.MONITOR_DEPLOY_FAILED] == 1 and run.data.metrics[M.MONITOR_DRIFT] == 1
    folder = DeployFolder(deploy_root)
    assert folder.linked(CURRENT).version == "2" and not folder.read_state()["reloaded"]


def test_engine_counters_that_cannot_be_true_are_an_error_not_a_confirmation(loop):
    cfg, world, engine, root = loop
    engine.acceptance = 10.0  # ten accepted tokens for every drafted one
    report = check(cfg, world)
    assert report.decision.status is Status.ERROR and report.exit_code == 2
    assert report.engine.impossible and not report.engine.mismatch and report.engine.test is None
    assert "cannot be true" in report.decision.reasons[-1]
    assert "confirmed" not in report.summary()
    # not verified: the next check reads the engine again
    assert DeployFolder(root / "deploy").read_state()["check"] == "pending"

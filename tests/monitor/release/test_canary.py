"""The canary (`monitor.deploy.canary`) through the monitor's checks, with three fake llama-server replicas on
127.0.0.1 whose counters the checks scrape: a challenger that serves worse on the canary is caught and rolled back
(only the canary's folder ever changed, the champion alias back, an alert naming it), a good one reaches every
replica, and a canary cut at any phase is finished by the next check (its state on disk)."""
import json
import os

import pytest
from mlflow import MlflowClient

from monitor.check import canary
from monitor.check.decision import Status
from monitor.check.deploy_hooks import CanaryDeploys
from monitor.check.run import run_check
from monitor.fleet.load import EngineLoad
from monitor.release import canary as steps
from monitor.release.canary import Canary
from monitor.release.layout import CURRENT, PREVIOUS, DeployFolder
from monitor.service.alerts import report_alerts
from pipeline import registry
from pipeline.config import load_config
from tests.monitor.check.test_deploy_hooks import EngineWorld
from tests.monitor.check.test_run import write_traffic
from tests.monitor.deploy_world import (
    NAME,
    calls_of,
    recorder,
    register_tiny_draft,
    start_engine,
    stop_engine,
    write_config,
)


@pytest.fixture
def fleet(tmp_path, mlflow_uri):
    """Version 1 registered; replicas a (the canary), b and c at acceptance 0.6; the config deploying to the fleet's
    folder and the canary's, each with its recording reload."""
    traffic = tmp_path / "traffic.jsonl"
    write_traffic(traffic, 0, 120)
    assert register_tiny_draft(tmp_path, seed=1) == "1"
    engines = {name: start_engine(acceptance=0.6) for name in "abc"}
    (tmp_path / "canary-reload").mkdir()
    canary_command, canary_calls = recorder(tmp_path / "canary-reload")
    path = write_config(tmp_path, mlflow_uri, traffic, engine_check="off",
                        canary={"replicas": ["a"], "windows": 2, "reload_command": canary_command})
    endpoints = [{"url": f"http://127.0.0.1:{e.server_port}/metrics", "replica": n} for n, e in engines.items()]
    cfg = load_config(path, [f"monitor.engines={json.dumps(endpoints)}", "monitor.server_baseline_windows=2",
                             "monitor.server_recent_windows=2"])
    yield cfg, engines, tmp_path, recorder(tmp_path)[1], canary_calls
    for engine in engines.values():
        stop_engine(engine)


def no_load(cfg, at):
    return {}, None


def check(cfg, world, **kw):
    return run_check(cfg, load=world.load, measure=world.measure, wait=lambda seconds: None, **kw)


def promote_version_2(cfg, world, root):
    """A drift (the target changed) retrains, gates and promotes version 2: the check starts a canary of it."""
    world.target_fingerprint, world.target_penalty["fp-B"] = "fp-B", 0.3
    retrain_cfg = cfg.model_copy(update={"monitor": cfg.monitor.model_copy(update={"retrain": True})})
    drift = run_check(retrain_cfg, load=world.load, measure=world.measure, wait=lambda s: None,
                      retrain=world.retrain_tiny(root, quality=0.3))
    assert drift.decision.status is Status.DRIFT and drift.retrain.promoted
    return drift


def judged(cfg, world, checks=6):
    """Checks until one judges the canary (each scrape closes one window per replica)."""
    for _ in range(checks):
        report = check(cfg, world)
        if report.canary is not None and report.canary.verdict != canary.COLLECTING:
            return report
    raise AssertionError("the canary was never judged")


@pytest.mark.parametrize("bad", [True, False])
def test_a_canary_catches_a_challenger_that_serves_worse_and_passes_a_good_one(fleet, bad):
    cfg, engines, root, calls, canary_calls = fleet
    world, fleet_root, canary_root = EngineWorld(), root / "deploy", root / "deploy" / "canary"
    fleet_folder, canary_folder = DeployFolder(fleet_root), DeployFolder(canary_root)
    first = check(cfg, world)  # version 1 to the fleet's folder and the canary's
    assert {r.deployment.version for r in first.deploys} == {"1"}
    assert fleet_folder.linked(CURRENT).version == canary_folder.linked(CURRENT).version == "1"

    drift = promote_version_2(cfg, world, root)
    assert [(r.action, r.deployment.version) for r in drift.deploys] == [("canary", "2")]
    assert canary_folder.linked(CURRENT).version == "2" and fleet_folder.linked(CURRENT).version == "1"
    assert Canary(cfg).read()["phase"] == steps.JUDGING and calls_of(canary_calls)[-1][0] == "2"
    if bad:
        engines["a"].acceptance = 0.3  # the canary serves the new draft worse than the others serve the old one

    report = judged(cfg, world)
    judgement = report.canary
    assert judgement.canary == ["a"] and judgement.others == ["b", "c"] and judgement.windows == 2
    assert judgement.power[0.10] > judgement.power[0.0] and judgement.power[0.0] < 0.1
    assert all(c[0] == "1" for c in calls_of(calls)[:1])
    if bad:
        assert judgement.verdict == canary.FAIL and judgement.acceptance < 0.4 < 0.55 < judgement.rest_acceptance
        assert [r.action for r in report.deploys] == ["canary-rollback"]
        assert canary_folder.linked(CURRENT).version == "1" and canary_folder.linked(PREVIOUS).version == "2"
        assert registry.champion(NAME).version == "1"
        assert [c[0] for c in calls_of(calls)] == ["1"]  # the fleet's folder: only ever version 1
        assert os.listdir(fleet_root / "versions") == ["v1"]
        assert Canary(cfg).read()["phase"] == steps.FAILED
        alert = next(a for a in report_alerts(report) if a.name == "CanaryFailed")
        assert alert.labels == {"replica": "a", "version": "2"} and "canary a" in alert.summary
        assert "acceptance 0.3" in alert.description and "on b, c" in alert.description
        after = check(cfg, world)  # nothing more happens: version 1 everywhere
        assert fleet_folder.linked(CURRENT).version == canary_folder.linked(CURRENT).version == "1"
        assert not [r for r in after.deploys if r.action != "none"]
    else:
        assert judgement.verdict == canary.PASS, judgement.summary()
        assert fleet_folder.linked(CURRENT).version == "2" and calls_of(calls)[-1][0] == "2"
        assert registry.champion(NAME).version == "2" and Canary(cfg).read()["phase"] == steps.PASSED
        assert not [a for a in report_alerts(report) if a.name == "CanaryFailed"]
    runs = MlflowClient().search_runs([MlflowClient().get_experiment_by_name("draftops-monitor").experiment_id])
    names = {r.info.run_name for r in runs}
    assert {"canary-deploying", "canary", f"canary-{'failed' if bad else 'passed'}"} <= names


def test_speed_below_the_others_fails_a_canary_whose_acceptance_passes(fleet):
    cfg, engines, root, _, _ = fleet
    world = EngineWorld()
    check(cfg, world)
    promote_version_2(cfg, world, root)
    slow = {"a": EngineLoad(1.0, 10.0), "b": EngineLoad(1.0, 30.0), "c": EngineLoad(1.0, 31.0)}
    for _ in range(6):
        report = check(cfg, world)
        state = Canary(cfg).read()
        judgement = canary.judge(cfg, state, report.server, slow)
        if judgement.verdict != canary.COLLECTING:
            break
    assert judgement.verdict == canary.FAIL and judgement.tokens_per_second == 10.0
    assert judgement.rest_tokens_per_second == pytest.approx(30.5) and "tokens/s 10.0 below 80%" in judgement.summary()


@pytest.mark.parametrize("phase", [steps.DEPLOYING, steps.ROLLING_BACK, steps.PROMOTING])
def test_a_canary_cut_at_any_phase_is_finished_by_the_next_check(fleet, phase):
    """A kill leaves canary.json in the phase it was in (written whole, before the phase's steps): a new process
    reading the same config finishes that phase, and each folder stays on a whole deployment."""
    cfg, engines, root, calls, _ = fleet
    fleet_root, canary_root = root / "deploy", root / "deploy" / "canary"
    fleet_folder, canary_folder = DeployFolder(fleet_root), DeployFolder(canary_root)
    assert CanaryDeploys(cfg).before_check()  # version 1 to both folders
    assert register_tiny_draft(root, seed=2) == "2"
    registry.promote(NAME, "2")
    state = {"version": "2", "previous": "1", "replicas": ["a"], "windows": 2,
             "started_at": "2026-01-01T00:00:00+00:00"}
    if phase == steps.DEPLOYING:  # killed before the canary's folder was switched
        Canary(cfg).save({**state, "phase": phase})
    elif phase == steps.ROLLING_BACK:  # the canary's folder switched back, killed before the alias moved
        Canary(cfg).resume_deploy({**state, "phase": steps.DEPLOYING})
        Canary(cfg).canary.roll_back("canary failed")
        Canary(cfg).save({**state, "phase": phase, "reason": "acceptance 0.3 vs 0.6"})
    else:  # passed, killed before the fleet's folder was switched
        Canary(cfg).resume_deploy({**state, "phase": steps.DEPLOYING})
        Canary(cfg).save({**state, "phase": phase, "figures": {"acceptance": 0.6}})

    engines_now = json.dumps([e.model_dump() for e in cfg.monitor.engines])
    restarted = load_config(root / "cfg.yaml", [f"monitor.engines={engines_now}", "monitor.server_baseline_windows=2",
                                                "monitor.server_recent_windows=2"])
    CanaryDeploys(restarted).before_check()
    ended = Canary(restarted).read()
    expected = {steps.DEPLOYING: ("2", "1", "2", steps.JUDGING), steps.ROLLING_BACK: ("1", "1", "1", steps.FAILED),
                steps.PROMOTING: ("2", "2", "2", steps.PASSED)}[phase]
    assert (canary_folder.linked(CURRENT).version, fleet_folder.linked(CURRENT).version,
            registry.champion(NAME).version, ended["phase"]) == expected
    for folder in (fleet_root, canary_root):
        assert DeployFolder(folder).read_state()["reloaded"] and DeployFolder(folder).linked(CURRENT) is not None


def test_power_is_stated_from_the_fleet_tests_simulation():
    from monitor.check.canary_power import canary_power
    power = canary_power(6, 2, 0.05, n_sims=200)
    assert power[0.0] <= 0.05 and power[0.05] < power[0.10] and power[0.10] > 0.6

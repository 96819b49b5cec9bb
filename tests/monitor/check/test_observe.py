"""What a check reads, read once and up front: after `observe` the check neither reads a baseline from the registry nor
the traffic again; the engine check's other versions' baselines are among what was read."""
import pytest

import monitor.check.run as run
from monitor.check.decision import Status
from monitor.check.deploy_hooks import CanaryDeploys, FleetDeploys, NoDeploys, deploys_of
from monitor.check.observe import observe
from pipeline import registry
from pipeline.config import load_config
from tests.monitor.check.test_run import check, check_world


def _refuse(*args, **kwargs):
    raise AssertionError("read after the check's observe step")


@pytest.mark.parametrize("checks", [1, 2])  # the first check records a baseline, the second compares with it
def test_after_observe_nothing_is_read_from_the_registrys_baselines_or_the_traffic(tmp_path, mlflow_uri, monkeypatch,
                                                                                   checks):
    cfg, world, _ = check_world(tmp_path, mlflow_uri)
    for _ in range(checks - 1):
        check(cfg, world)
    seen = []

    def observe_then_refuse(*args):
        seen.append(observe(*args))
        for name in ("load_baseline", "stored_baseline", "break_even", "find_version"):
            monkeypatch.setattr(registry, name, _refuse)
        monkeypatch.setattr("pipeline.traffic.load_configured_traffic", _refuse)
        return seen[-1]

    monkeypatch.setattr(run, "observe", observe_then_refuse)
    report = check(cfg, world)
    assert report.decision.status is Status.OK and len(seen) == 1
    assert (seen[0].baseline is None) == (checks == 1) and len(seen[0].heldout) >= cfg.monitor.heldout_requests
    assert seen[0].stored == {} and seen[0].engine is None and seen[0].server is None


def test_a_version_without_a_baseline_or_unknown_to_the_registry_has_no_stored_baseline(tmp_path, mlflow_uri):
    cfg, world, _ = check_world(tmp_path, mlflow_uri)
    registry_name = cfg.tracking.registered_model
    assert registry.stored_baseline(registry_name, "1") is None
    check(cfg, world)
    assert registry.stored_baseline(registry_name, "1")["target_fingerprint"] == "fp-A"
    assert registry.stored_baseline(registry_name, "7") is None


def test_the_way_a_check_deploys_is_chosen_once_from_the_config(tmp_path):
    base = [f"monitor.deploy.dir={tmp_path / 'deploy'}"]
    assert isinstance(deploys_of(load_config(None, base)), NoDeploys)
    fleet = deploys_of(load_config(None, base + ["monitor.deploy.enabled=true"]))
    assert type(fleet) is FleetDeploys and fleet.fleet.folder.root == (tmp_path / "deploy").resolve()
    canary = deploys_of(load_config(None, base + ["monitor.deploy.enabled=true",
                                                  "monitor.deploy.canary.replicas=[a]",
                                                  "monitor.deploy.canary.reload_url=http://127.0.0.1:9/reload"]))
    assert isinstance(canary, CanaryDeploys) and canary.fleet is canary.steps.fleet
    assert canary.steps.canary.folder.root == (tmp_path / "deploy" / "canary").resolve()
    assert NoDeploys().before_check() == [] and NoDeploys().after_check(None) is None

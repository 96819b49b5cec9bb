"""How a monitor check deploys (`monitor.deploy`): not at all, to the fleet's folder, or through a canary first.

One object per way, chosen once from the config (`deploys_of`), each with the two moments a check deploys at:
before it reads the engines (a champion not yet deployed, a step a kill cut short) and after its run is logged (the
post-deploy check recorded, the deployment rolled back on a mismatch, a promoted challenger deployed or its canary
begun, a canary judged). A deploy that fails does not stop the check (it still measures and is recorded, and the next
check tries again), but it is never an OK: `with_deploys` makes the decision DEPLOY_FAILED, with its own exit code."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from monitor.check.canary import FAIL, PASS, judge
from monitor.check.decision import Decision, Status
from monitor.fleet.load import read_load
from monitor.release import canary as steps
from monitor.release.canary import Canary
from monitor.release.layout import MISMATCH, VERIFIED, DeployError
from monitor.release.rollout import FAILED, DeployResult, Rollout, reported
from pipeline import registry
from pipeline.config import DraftopsConfig

log = logging.getLogger("draftops.monitor")


def _safely(what: str, fn: Callable[[], list[DeployResult] | None]) -> list[DeployResult]:
    """`fn`'s results (none for None), or one FAILED result naming `what` and why (logged): a deploy never stops the
    check."""
    try:
        return fn() or []
    except (DeployError, registry.RegistryError, OSError) as exc:
        log.error("%s failed: %s", what, exc)
        return [DeployResult(FAILED, None, notes=[f"{what} failed: {exc}"])]


class NoDeploys:
    """`monitor.deploy.enabled: false`: the check deploys nothing."""

    def before_check(self) -> list[DeployResult]:
        return []

    def after_check(self, report) -> None:
        return None


class FleetDeploys:
    """Every replica serves the fleet's deploy folder (monitor.release.rollout)."""

    def __init__(self, cfg: DraftopsConfig):
        self.cfg, self.fleet = cfg, Rollout(cfg)

    def champion(self) -> str:
        return registry.champion(self.cfg.tracking.registered_model).version

    def before_check(self) -> list[DeployResult]:
        """The champion deployed (and the engine reloaded) before the check reads the engine."""
        return reported(_safely("deploy of the champion", lambda: [self.fleet.ensure(self.champion())]))

    def after_check(self, report) -> None:
        """The post-deploy check recorded (and acted on), then a promoted challenger deployed. Appends to
        `report.deploys`."""
        self.record_post_deploy(report)
        if report.retrain is not None and report.retrain.promoted:
            report.deploys += _safely("deploy of the new champion",
                                      lambda: [self.fleet.ensure(report.retrain.challenger_version)])

    def record_post_deploy(self, report) -> None:
        """The post-deploy check's outcome into deploy.json; on a mismatch, the deployment rolled back when
        `rollback_on_mismatch`."""
        engine = report.engine
        if engine is None or not engine.post_deploy or engine.test is None:
            return
        report.deploys += _safely("record of the post-deploy check",
                                  lambda: self.fleet.record_check(MISMATCH if engine.mismatch else VERIFIED))
        if engine.mismatch and self.cfg.monitor.deploy.rollback_on_mismatch:
            report.deploys += _safely("rollback of the deployment", lambda: [self.fleet.roll_back(
                f"post-deploy check: DEPLOY_MISMATCH on version {engine.version}")])


STEP_NAMES = {steps.DEPLOYING: "canary deploy", steps.PROMOTING: "canary rollout",
              steps.ROLLING_BACK: "canary rollback"}


class CanaryDeploys(FleetDeploys):
    """`monitor.deploy.canary`: a new champion goes to the canary replicas first, is judged on what the engines count
    (monitor.check.canary), then rolled out to every replica or rolled back (monitor.release.canary)."""

    def __init__(self, cfg: DraftopsConfig, *, load: Callable = read_load):
        self.cfg, self.steps, self.load = cfg, Canary(cfg), load
        self.fleet = self.steps.fleet

    def before_check(self) -> list[DeployResult]:
        """The canary step a kill cut short finished, or a new champion's canary begun, or both folders brought to
        the champion (monitor.release.canary.catch_up)."""
        state = self.steps.read()
        what = STEP_NAMES.get(state.get("phase"), "deploy of the champion")
        return _safely(what, lambda: self.steps.catch_up(state, self.champion()))

    def after_check(self, report) -> None:
        """A promoted challenger begins a canary; a canary being judged is judged on this check's windows and rolled
        out or back. Appends to `report.deploys`, sets `report.canary`."""
        self.record_post_deploy(report)
        retrain = report.retrain
        if retrain is not None and retrain.promoted:
            report.deploys += _safely("canary deploy", lambda: self.steps.begin_after_promotion(
                retrain.challenger_version, retrain.previous_champion))
            return
        state = self.steps.read()
        if state.get("phase") != steps.JUDGING:
            return
        loads, _ = self.load(self.cfg, time.time())
        judgement = report.canary = judge(self.cfg, state, report.server, loads)
        if judgement.verdict in (PASS, FAIL):
            reason = f"canary {', '.join(judgement.canary)}: " + "; ".join(judgement.reasons)
            what = STEP_NAMES[steps.PROMOTING if judgement.verdict == PASS else steps.ROLLING_BACK]
            report.deploys += _safely(what, lambda: self.steps.conclude(
                state, judgement.verdict == PASS, judgement.figures(), reason, report.champion_version))


def deploys_of(cfg: DraftopsConfig) -> NoDeploys | FleetDeploys | CanaryDeploys:
    """How this config's checks deploy."""
    d = cfg.monitor.deploy
    if not d.enabled:
        return NoDeploys()
    return CanaryDeploys(cfg) if d.canary.replicas else FleetDeploys(cfg)


def with_deploys(decision: Decision, deploys: list[DeployResult]) -> Decision:
    """DEPLOY_FAILED when one of `deploys` failed (an ERROR stays an ERROR, with the failures added to its reasons);
    the reasons of the decision it replaces are kept in its notes."""
    failures = [note for result in deploys if result.action == FAILED for note in result.notes]
    if not failures:
        return decision
    if decision.status in (Status.ERROR, Status.DEPLOY_FAILED):
        return Decision(decision.status, None, decision.reasons + failures, decision.notes)
    was = decision.status.value + (f" ({decision.cause.value})" if decision.cause else "")
    return Decision(Status.DEPLOY_FAILED, None, failures, [f"also {was}: {r}" for r in decision.reasons]
                    + decision.notes)

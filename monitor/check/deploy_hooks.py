"""Where a monitor check deploys: before it (a champion not yet deployed, or a reload a kill cut short), and after it
(the post-deploy check's outcome recorded, the deployment rolled back on a mismatch when configured, a promoted
challenger deployed, or with `monitor.deploy.canary` a canary started and judged: monitor.check.canary). A deploy
that fails does not stop the check (it still measures and is recorded, and the next
check tries again), but it is never an OK: the check's decision becomes DEPLOY_FAILED, with its own exit code."""
from __future__ import annotations

import logging
from collections.abc import Callable

from monitor.check import canary
from monitor.check.decision import Decision, Status
from monitor.release.layout import MISMATCH, VERIFIED, DeployError
from monitor.release.rollout import FAILED, DeployResult, ensure_deployed, record_check, rollback_deployment
from pipeline import registry
from pipeline.config import DraftopsConfig

log = logging.getLogger("draftops.monitor")


def _failed(what: str, exc: Exception) -> DeployResult:
    log.error("%s failed: %s", what, exc)
    return DeployResult(FAILED, None, notes=[f"{what} failed: {exc}"])


def _safely(what: str, fn: Callable[[], DeployResult]) -> DeployResult:
    try:
        return fn()
    except (DeployError, registry.RegistryError, OSError) as exc:
        return _failed(what, exc)


def deploy_before(cfg: DraftopsConfig) -> list[DeployResult]:
    """The champion deployed (and the engine reloaded) before the check reads the engine, when deploys are on."""
    if not cfg.monitor.deploy.enabled:
        return []
    if canary.steps.enabled(cfg):
        return canary.before_check(cfg)
    result = _safely("deploy of the champion", lambda: ensure_deployed(cfg))
    return [] if result.action == "none" and not result.notes else [result]


def deploy_after(cfg: DraftopsConfig, report) -> None:
    """After the check's run is logged: record the post-deploy check, roll the deployment back on a mismatch (when
    `rollback_on_mismatch`), deploy a promoted challenger. Appends to `report.deploys`."""
    d, engine = cfg.monitor.deploy, report.engine
    if engine is not None and engine.post_deploy and engine.test is not None:
        try:
            record_check(cfg, MISMATCH if engine.mismatch else VERIFIED)
        except DeployError as exc:
            report.deploys.append(_failed("record of the post-deploy check", exc))
        if engine.mismatch and d.rollback_on_mismatch:
            report.deploys.append(_safely("rollback of the deployment", lambda: rollback_deployment(
                cfg, f"post-deploy check: DEPLOY_MISMATCH on version {engine.version}")))
    if canary.steps.enabled(cfg):
        canary.after_check(cfg, report)
    elif d.enabled and report.retrain is not None and report.retrain.promoted:
        report.deploys.append(_safely("deploy of the new champion", lambda: ensure_deployed(cfg)))


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

"""Where a monitor check deploys: before it (a champion not yet deployed, or a reload a kill cut short), and after it
(the post-deploy check's outcome recorded, the deployment rolled back on a mismatch when configured, a promoted
challenger deployed). A deploy that fails never fails the check: it is reported, and the next check tries again."""
from __future__ import annotations

import logging
from collections.abc import Callable

from monitor.deploy.rollout import (
    MISMATCH,
    VERIFIED,
    DeployError,
    DeployResult,
    ensure_deployed,
    record_check,
    rollback_deployment,
)
from pipeline import registry
from pipeline.config import DraftopsConfig

log = logging.getLogger("draftops.monitor")


def _safely(what: str, fn: Callable[[], DeployResult]) -> DeployResult:
    try:
        return fn()
    except (DeployError, registry.RegistryError, OSError) as exc:
        log.error("%s failed: %s", what, exc)
        return DeployResult("failed", None, notes=[f"{what} failed: {exc}"])


def deploy_before(cfg: DraftopsConfig) -> list[DeployResult]:
    """The champion deployed (and the engine reloaded) before the check reads the engine, when deploys are on."""
    if not cfg.monitor.deploy.enabled:
        return []
    result = _safely("deploy of the champion", lambda: ensure_deployed(cfg))
    return [] if result.action == "none" and not result.notes else [result]


def deploy_after(cfg: DraftopsConfig, report) -> None:
    """After the check's run is logged: record the post-deploy check, roll the deployment back on a mismatch (when
    `rollback_on_mismatch`), deploy a promoted challenger. Appends to `report.deploys`."""
    d, engine = cfg.monitor.deploy, report.engine
    if engine is not None and engine.post_deploy and engine.test is not None:
        record_check(cfg, MISMATCH if engine.mismatch else VERIFIED)
        if engine.mismatch and d.rollback_on_mismatch:
            report.deploys.append(_safely("rollback of the deployment", lambda: rollback_deployment(
                cfg, f"post-deploy check: DEPLOY_MISMATCH on version {engine.version}")))
    if d.enabled and report.retrain is not None and report.retrain.promoted:
        report.deploys.append(_safely("deploy of the new champion", lambda: ensure_deployed(cfg)))

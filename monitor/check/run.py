"""One monitor check: does the champion draft still fit the current target and traffic?

Read, decide, act. The check deploys first where a deploy is due (monitor.check.deploy_hooks: the champion not yet
deployed, a step a kill cut short); reads everything it decides on (monitor.check.observe: the champion and its
baseline, the held-out traffic, the engines' windows, the models); measures and decides (monitor.check.assess: OK,
DRIFT with its cause, DEPLOY_MISMATCH, ERROR; on DRIFT a challenger distilled and gated); then acts: the check logged
as a run with the baselines and a promotion (monitor.check.outcome), and the deploys after it (a promoted
challenger, a canary judged, a rollback on a mismatch). A deploy that failed, before or after, makes the check
DEPLOY_FAILED (exit 5), in its report and its run's tags.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from decode.serving.loading import load_draft, load_model
from monitor.check.assess import Measure, assess
from monitor.check.decision import EXIT_ERROR
from monitor.check.deploy_hooks import deploys_of, with_deploys
from monitor.check.observe import observe
from monitor.check.outcome import CheckReport, log_deploy_failure, log_run
from monitor.check.prompt_acceptance import measure_analytic, measure_live
from monitor.check.retrain import distill_challenger
from pipeline import metrics as M
from pipeline import registry
from pipeline.config import DraftopsConfig
from pipeline.tracking import setup_mlflow, start_run

log = logging.getLogger("draftops.monitor")

def load_models(cfg: DraftopsConfig, draft_source: str, target=None):
    """(target, draft) as ResolvedModels on the configured device (reusing `target` if given); tokenizers must agree."""

    target = target or load_model(cfg.target, device=cfg.device, dtype=cfg.dtype, cpu_linear=cfg.cpu_linear)
    return target, load_draft(draft_source, target, cpu_linear=cfg.cpu_linear)


def run_check(cfg: DraftopsConfig, *, load: Callable = load_models, measure: Measure = measure_analytic,
              measure_live_fn: Measure = measure_live, retrain: Callable[[DraftopsConfig], str] | None = None,
              wait: Callable[[float], None] = time.sleep) -> CheckReport:
    """One check (see the module docstring). `load`, `measure*` and `retrain` are the model-facing steps; `wait(s)`
    lets the engine check's windows pass."""
    setup_mlflow(cfg)
    deploys = deploys_of(cfg)
    deployed = deploys.before_check()
    seen = observe(cfg, load, wait)
    report, to_record = assess(cfg, seen, deployed, load=load, measure=measure, measure_live_fn=measure_live_fn,
                               retrain=retrain or distill_challenger)
    log_run(cfg, report, to_record)
    before = len(report.deploys)
    deploys.after_check(report)
    decision = with_deploys(report.decision, report.deploys[before:])
    if decision is not report.decision:  # a deploy after the run failed: DEPLOY_FAILED, the run tagged again
        report.decision = decision
        log_deploy_failure(report)
    log.info("monitor check: %s", report.summary())
    return report


def scheduled_check(cfg: DraftopsConfig) -> CheckReport | int:
    """What the service runs (under its lock): a check with retraining as configured; its report (the service
    records and alerts on it), or the exit code of a check that could not report."""
    try:
        return run_check(cfg)
    except registry.RegistryError as exc:
        log.error("monitor check: %s", exc)
        return EXIT_ERROR


def rollback(cfg: DraftopsConfig, to_version: str | None = None) -> str:
    """Move the champion alias back (to previous-champion or `to_version`) and record it as a monitor run."""

    setup_mlflow(cfg)
    name = cfg.tracking.registered_model
    before = registry.champion(name).version
    after = registry.rollback(name, to_version)
    with start_run(cfg, "monitor", run_name="rollback",
                   tags={M.MONITOR_DECISION_TAG: "ROLLBACK", M.MONITOR_ROLLED_BACK_FROM_TAG: before,
                         M.MONITOR_CHAMPION_VERSION_TAG: after}):
        pass
    return after

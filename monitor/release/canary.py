"""The canary's deployments and its state (`monitor.deploy.canary`): a new champion deployed to the canary replicas
alone, then to every replica, or the canary rolled back and the champion alias moved back.

The canary replicas serve a deploy folder of their own (`canary.dir`, default `<monitor.deploy.dir>/canary`), laid
out as the fleet's (monitor.release.layout: versions/, `current`, `previous`, deploy.json) and written by the same
rollout (monitor.release.rollout) with the canary's reload action; so each folder, the canary's and the fleet's, is
always on a whole deployment, whatever step a kill stops. What the canary is doing is kept in
`<monitor.deploy.dir>/canary.json`, replaced whole (pipeline.files.write_text_atomic), with its phase:

    deploying     the challenger being deployed to the canary (the canary first brought to the old champion)
    judging       deployed; each check compares the canary's windows with the other replicas' (monitor.check.canary)
    promoting     passed: the fleet's folder being switched to the challenger
    rolling_back  failed: the canary's folder switched back, then the champion alias moved back
    passed, failed  done

Every step is idempotent (it looks at the folders and the registry before it acts), so a restarted service finishes
the phase it finds. Each step is an MLflow run in `draftops-monitor` (run names `canary-<phase>`), beside the deploy
and rollback runs the rollout logs itself.
"""
from __future__ import annotations

import json
import logging
from datetime import datetime, timezone
from pathlib import Path

from monitor.release.layout import CURRENT, DeployFolder
from monitor.release.rollout import DeployResult, deploy_version, ensure_deployed, rollback_deployment
from pipeline import metrics as M
from pipeline import registry
from pipeline.config import DraftopsConfig
from pipeline.files import write_text_atomic
from pipeline.tracking import setup_mlflow, start_run

log = logging.getLogger("draftops.monitor")

STATE_FILE = "canary.json"
DEPLOYING, JUDGING, PROMOTING, ROLLING_BACK, PASSED, FAILED = (
    "deploying", "judging", "promoting", "rolling_back", "passed", "failed")
IN_PROGRESS = (DEPLOYING, JUDGING, PROMOTING, ROLLING_BACK)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def enabled(cfg: DraftopsConfig) -> bool:
    return cfg.monitor.deploy.enabled and bool(cfg.monitor.deploy.canary.replicas)


def canary_config(cfg: DraftopsConfig) -> DraftopsConfig:
    """`cfg` with the canary's deploy folder and reload action in place of the fleet's: what the rollout runs for the
    canary replicas."""
    d, c = cfg.monitor.deploy, cfg.monitor.deploy.canary
    folder = c.dir or str(Path(d.dir) / "canary")
    deploy = d.model_copy(update={"dir": folder, "reload": c.reload, "reload_command": list(c.reload_command),
                                  "reload_url": c.reload_url})
    return cfg.model_copy(update={"monitor": cfg.monitor.model_copy(update={"deploy": deploy})})


def state_path(cfg: DraftopsConfig) -> Path:
    return DeployFolder.of(cfg).root / STATE_FILE


def read(cfg: DraftopsConfig) -> dict:
    """The canary's state ({} when none ever ran)."""
    try:
        return json.loads(state_path(cfg).read_text())
    except (OSError, ValueError):
        return {}


def save(cfg: DraftopsConfig, state: dict) -> dict:
    path = state_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(state, indent=1))
    return state


def in_progress(state: dict) -> bool:
    return state.get("phase") in IN_PROGRESS


def on(cfg: DraftopsConfig, version: str) -> DeployResult | None:
    """Deploy `version` to the canary's folder (`cfg` from canary_config) unless it is current there and reloaded
    (None then)."""
    folder = DeployFolder.of(cfg)
    current, state = folder.linked(CURRENT), folder.read_state()
    if (current is not None and current.version == version and current.format == cfg.monitor.deploy.format
            and state.get("folder") == current.folder.name and state.get("reloaded")):
        return None
    return deploy_version(cfg, version, action="canary")


def begin(cfg: DraftopsConfig, version: str, previous: str | None) -> list[DeployResult]:
    """Start a canary of `version` (the old champion `previous`, what the other replicas keep serving): the state
    written first, then the canary's folder brought to `previous` (so that a rollback has it to go back to) and
    switched to `version`."""
    c = cfg.monitor.deploy.canary
    state = save(cfg, {"version": version, "previous": previous, "replicas": list(c.replicas), "windows": c.windows,
                       "started_at": _now(), "phase": DEPLOYING})
    log_step(cfg, state, {})
    return resume_deploy(cfg, state)


def resume_deploy(cfg: DraftopsConfig, state: dict) -> list[DeployResult]:
    """The `deploying` phase, from wherever a kill stopped it; then `judging`."""
    canary, results = canary_config(cfg), []
    current = DeployFolder.of(canary).linked(CURRENT)
    if state.get("previous") and (current is None or current.version not in (state["previous"], state["version"])):
        results.append(deploy_version(canary, state["previous"], action="canary"))
    done = on(canary, state["version"])
    results += [done] if done is not None else []
    save(cfg, {**state, "phase": JUDGING, "deployed_at": _now()})
    return results


def catch_up(cfg: DraftopsConfig, state: dict) -> list[DeployResult]:
    """What a check deploys first: the step a kill cut short (deploying, promoting, rolling_back) finished; nothing
    while the canary is judged; else a new champion the fleet does not serve yet starts a canary, or both folders are
    brought to the champion (a reload a kill cut short, a first deploy)."""
    phase = state.get("phase")
    if phase == DEPLOYING:
        return resume_deploy(cfg, state)
    if phase == PROMOTING:
        return promote(cfg, state, {})
    if phase == ROLLING_BACK:
        return roll_back(cfg, state, {}, "")
    if phase == JUDGING:
        return []
    champion = registry.champion(cfg.tracking.registered_model).version
    current = DeployFolder.of(cfg).linked(CURRENT)
    if current is not None and current.version != champion and int(champion) > int(current.version):
        return begin(cfg, champion, current.version)
    results = [ensure_deployed(cfg)]
    canary = on(canary_config(cfg), champion)
    results += [canary] if canary is not None else []
    return [r for r in results if r.action != "none" or r.notes]


def begin_after_promotion(cfg: DraftopsConfig, challenger: str, previous_champion: str | None) -> list[DeployResult]:
    """A promoted challenger's canary; its way back is what the fleet's folder serves (else the previous champion)."""
    serving = DeployFolder.of(cfg).linked(CURRENT)
    return begin(cfg, challenger, serving.version if serving is not None else previous_champion)


def conclude(cfg: DraftopsConfig, state: dict, passed: bool, figures: dict, reason: str) -> list[DeployResult]:
    """A judged canary rolled out to every replica (passed) or rolled back."""
    return promote(cfg, state, figures) if passed else roll_back(cfg, state, figures, reason)


def promote(cfg: DraftopsConfig, state: dict, figures: dict) -> list[DeployResult]:
    """The canary passed: the fleet's folder switched to the challenger (the champion), then `passed`."""
    state = save(cfg, {**state, "phase": PROMOTING, "figures": figures or state.get("figures", {})})
    result = ensure_deployed(cfg)
    state = save(cfg, {**state, "phase": PASSED, "ended_at": _now()})
    log_step(cfg, state, state["figures"])
    return [] if result.action == "none" and not result.notes else [result]


def roll_back(cfg: DraftopsConfig, state: dict, figures: dict, reason: str) -> list[DeployResult]:
    """The canary failed: its folder switched back to the old champion, the champion alias moved back to it (when it
    still points at the challenger), then `failed`. The fleet's folder is never touched."""
    state = save(cfg, {**state, "phase": ROLLING_BACK, "figures": figures or state.get("figures", {}),
                       "reason": reason or state.get("reason", "")})
    canary, results = canary_config(cfg), []
    current = DeployFolder.of(canary).linked(CURRENT)
    if current is not None and current.version == state["version"]:
        result = rollback_deployment(canary, f"canary failed: {state['reason']}")
        result.action = "canary-rollback"
        results.append(result)
    name = cfg.tracking.registered_model
    setup_mlflow(cfg)
    if state.get("previous") and registry.champion(name).version == state["version"]:
        registry.rollback(name, state["previous"])
    state = save(cfg, {**state, "phase": FAILED, "ended_at": _now()})
    log_step(cfg, state, state["figures"])
    return results


def log_step(cfg: DraftopsConfig, state: dict, figures: dict) -> str:
    """One canary step as an MLflow run (`canary-<phase>`): the versions, replicas and figures."""
    import mlflow

    tags = {M.MONITOR_DECISION_TAG: f"CANARY_{state['phase'].upper()}", M.DEPLOY_VERSION_TAG: state["version"],
            M.MONITOR_CHAMPION_VERSION_TAG: state["version"], M.REGISTERED_MODEL_TAG: cfg.tracking.registered_model}
    with start_run(cfg, "monitor", run_name=f"canary-{state['phase']}", tags=tags) as run:
        mlflow.log_params({"canary.version": state["version"], "canary.previous": state.get("previous"),
                           "canary.replicas": ",".join(state["replicas"]), "canary.windows": state["windows"]})
        numbers = {f"canary/{k}": float(v) for k, v in figures.items() if isinstance(v, (int, float))
                   and not isinstance(v, bool) and v == v}
        if numbers:
            mlflow.log_metrics(numbers)
        mlflow.log_dict(state, "canary/state.json")
    return run.info.run_id

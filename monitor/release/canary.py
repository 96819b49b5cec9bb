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

from monitor.release.rollout import DeployResult, Rollout, reported
from pipeline import metrics as M
from pipeline import registry
from pipeline.config import DraftopsConfig
from pipeline.config.deploy import DeployConfig
from pipeline.files import write_text_atomic
from pipeline.tracking import start_run

log = logging.getLogger("draftops.monitor")

STATE_FILE = "canary.json"
DEPLOYING, JUDGING, PROMOTING, ROLLING_BACK, PASSED, FAILED = (
    "deploying", "judging", "promoting", "rolling_back", "passed", "failed")
IN_PROGRESS = (DEPLOYING, JUDGING, PROMOTING, ROLLING_BACK)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def canary_deploy(cfg: DraftopsConfig) -> DeployConfig:
    """`monitor.deploy` with the canary's folder and reload action in place of the fleet's: what the canary replicas'
    rollout runs."""
    d, c = cfg.monitor.deploy, cfg.monitor.deploy.canary
    return d.model_copy(update={"dir": c.dir or str(Path(d.dir) / "canary"), "reload": c.reload,
                                "reload_command": list(c.reload_command), "reload_url": c.reload_url})


def in_progress(state: dict) -> bool:
    return state.get("phase") in IN_PROGRESS


class Canary:
    """The canary of one config: its state file, the fleet's rollout and the canary replicas' (module docstring)."""

    def __init__(self, cfg: DraftopsConfig):
        self.cfg = cfg
        self.fleet, self.canary = Rollout(cfg), Rollout(cfg, canary_deploy(cfg))
        self.path = self.fleet.folder.root / STATE_FILE

    def read(self) -> dict:
        """The canary's state ({} when none ever ran)."""
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def save(self, state: dict) -> dict:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.path, json.dumps(state, indent=1))
        return state

    def _on_canary(self, version: str) -> list[DeployResult]:
        """`version` deployed to the canary's folder, unless it is current there and reloaded."""
        return [] if self.canary.serves(version) else [self.canary.deploy_version(version, action="canary")]

    def catch_up(self, state: dict, champion: str) -> list[DeployResult]:
        """What a check deploys first: the step a kill cut short (deploying, promoting, rolling_back) finished;
        nothing while the canary is judged; else a new `champion` the fleet does not serve yet begins a canary, or
        both folders are brought to the champion (a reload a kill cut short, a first deploy)."""
        phase = state.get("phase")
        if phase == DEPLOYING:
            return self.resume_deploy(state)
        if phase == PROMOTING:
            return self.promote(state, {}, champion)
        if phase == ROLLING_BACK:
            return self.roll_back(state, {}, "")
        if phase == JUDGING:
            return []
        current = self.fleet.current()
        if current is not None and current.version != champion and int(champion) > int(current.version):
            return self.begin(champion, current.version)
        results = [self.fleet.ensure(champion)] + self._on_canary(champion)
        return reported(results)

    def begin(self, version: str, previous: str | None) -> list[DeployResult]:
        """Start a canary of `version` (the old champion `previous`, what the other replicas keep serving): the
        state written first, then the canary's folder brought to `previous` (so that a rollback has it to go back
        to) and switched to `version`."""
        c = self.cfg.monitor.deploy.canary
        state = self.save({"version": version, "previous": previous, "replicas": list(c.replicas),
                           "windows": c.windows, "started_at": _now(), "phase": DEPLOYING})
        self.log_step(state, {})
        return self.resume_deploy(state)

    def begin_after_promotion(self, challenger: str, previous_champion: str | None) -> list[DeployResult]:
        """A promoted challenger's canary; its way back is what the fleet's folder serves (else the previous
        champion)."""
        serving = self.fleet.current()
        return self.begin(challenger, serving.version if serving is not None else previous_champion)

    def resume_deploy(self, state: dict) -> list[DeployResult]:
        """The `deploying` phase, from wherever a kill stopped it; then `judging`."""
        current, results = self.canary.current(), []
        if state.get("previous") and (current is None or current.version not in (state["previous"], state["version"])):
            results.append(self.canary.deploy_version(state["previous"], action="canary"))
        results += self._on_canary(state["version"])
        self.save({**state, "phase": JUDGING, "deployed_at": _now()})
        return results

    def conclude(self, state: dict, passed: bool, figures: dict, reason: str, champion: str) -> list[DeployResult]:
        """A judged canary rolled out to every replica (passed) or rolled back."""
        return self.promote(state, figures, champion) if passed else self.roll_back(state, figures, reason)

    def promote(self, state: dict, figures: dict, champion: str) -> list[DeployResult]:
        """The canary passed: the fleet's folder switched to `champion` (the challenger the canary ran), then
        `passed`."""
        state = self.save({**state, "phase": PROMOTING, "figures": figures or state.get("figures", {})})
        result = self.fleet.ensure(champion)
        state = self.save({**state, "phase": PASSED, "ended_at": _now()})
        self.log_step(state, state["figures"])
        return reported([result])

    def roll_back(self, state: dict, figures: dict, reason: str) -> list[DeployResult]:
        """The canary failed: its folder switched back to the old champion, the champion alias moved back to it
        (when it still points at the challenger), then `failed`. The fleet's folder is never touched."""
        state = self.save({**state, "phase": ROLLING_BACK, "figures": figures or state.get("figures", {}),
                           "reason": reason or state.get("reason", "")})
        results, current = [], self.canary.current()
        if current is not None and current.version == state["version"]:
            result = self.canary.roll_back(f"canary failed: {state['reason']}")
            result.action = "canary-rollback"
            results.append(result)
        name = self.cfg.tracking.registered_model
        if state.get("previous") and registry.champion(name).version == state["version"]:
            registry.rollback(name, state["previous"])
        state = self.save({**state, "phase": FAILED, "ended_at": _now()})
        self.log_step(state, state["figures"])
        return results

    def log_step(self, state: dict, figures: dict) -> str:
        """One canary step as an MLflow run (`canary-<phase>`): the versions, replicas and figures."""
        import mlflow

        tags = {M.MONITOR_DECISION_TAG: f"CANARY_{state['phase'].upper()}", M.DEPLOY_VERSION_TAG: state["version"],
                M.MONITOR_CHAMPION_VERSION_TAG: state["version"],
                M.REGISTERED_MODEL_TAG: self.cfg.tracking.registered_model}
        with start_run(self.cfg, "monitor", run_name=f"canary-{state['phase']}", tags=tags) as run:
            mlflow.log_params({"canary.version": state["version"], "canary.previous": state.get("previous"),
                               "canary.replicas": ",".join(state["replicas"]), "canary.windows": state["windows"]})
            numbers = {f"canary/{k}": float(v) for k, v in figures.items() if isinstance(v, (int, float))
                       and not isinstance(v, bool) and v == v}
            if numbers:
                mlflow.log_metrics(numbers)
            mlflow.log_dict(state, "canary/state.json")
        return run.info.run_id

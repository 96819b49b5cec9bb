"""Deploy the champion to a serving engine: export it into a deploy folder, switch atomically, reload the engine.

The deploy folder's layout is in `monitor.release.layout`. A deploy exports into a folder of its own (through
`pipeline.files`: a temporary sibling swapped in), writes the manifest, writes deploy.json (not reloaded), points
`previous` at the folder `current` points at, then flips `current` (a new symlink renamed over the old one: one
rename, so a reader sees the old target or the new one), then runs the reload action and records it. A process killed
anywhere leaves `current` on a whole deployment, old or new; the next deploy (or check) finishes what was cut: the
engine is reloaded when `current` holds the champion but deploy.json does not say it was. The folder of a version
already exported in the same format is reused (a rollback flips back to it). The newest `keep` folders are kept, and
always `current` and `previous`.

The reload action (`monitor.deploy.reload`: a command, a request, or the draft's weights pushed to vLLM or SGLang) is
planned before the switch, so a command that cannot be built stops the deploy before `current` moves, and runs after
it under one deadline. deploy.json says `reloaded` only once the reload succeeded. Each deploy, and each rollback of a
deployment, is an MLflow run in `draftops-monitor`, and the deployed version carries the folder, format and time as
tags. A deploy that fails raises DeployError, one line naming its step (lock, export, manifest, state, switch,
reload) and why, never a traceback.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from decode.serving.export import ExportError, draft_source, export_format, folder_vocab_size, target_gguf
from monitor.release.layout import (
    CURRENT,
    MANIFEST,
    PENDING,
    PREVIOUS,
    ROLLED_BACK,
    DeployError,
    DeployFolder,
    Deployment,
    read_manifest,
    step,
)
from monitor.release.reload import ReloadError, check_reload, plan_reload
from pipeline import metrics as M
from pipeline import registry
from pipeline.config import DraftopsConfig
from pipeline.config.deploy import DeployConfig
from pipeline.files import write_text_atomic
from pipeline.tracking import setup_mlflow, start_run


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


FAILED = "failed"  # the action of a DeployResult that stands for a deploy that failed (monitor.check.deploy_hooks)


@dataclass
class DeployResult:
    """What a deploy (or a rollback of a deployment) did."""

    action: str  # deploy, rollback, reload, none, failed
    deployment: Deployment | None
    previous: Deployment | None = None
    exported: bool = False
    reloaded: bool = False
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    run_id: str | None = None

    def summary(self) -> str:
        if self.deployment is None or self.action == "none":
            return "deploy: " + ("; ".join(self.notes) or (f"version {self.deployment.version} is deployed" if
                                                           self.deployment else "nothing to do"))
        d = self.deployment
        line = (f"deploy ({self.action}): version {d.version} as {d.format} at {d.folder}"
                f"{f' (previous: version {self.previous.version})' if self.previous else ''}; "
                f"{'exported, ' if self.exported else ''}{'engine reloaded' if self.reloaded else 'not reloaded'}")
        return "\n".join([line] + [f"  {n}" for n in self.notes])

    def to_dict(self) -> dict:
        return {"action": self.action, "deployment": self.deployment and self.deployment.to_dict(),
                "previous": self.previous and self.previous.to_dict(), "exported": self.exported,
                "reloaded": self.reloaded, "notes": self.notes, "seconds": self.seconds, "run_id": self.run_id}


def reported(results: list[DeployResult]) -> list[DeployResult]:
    """What was done, or what has a note: a deploy that found nothing to do is left out of a check's report."""
    return [r for r in results if r.action != "none" or r.notes]


class Rollout:
    """One deploy folder and the deploys into it (module docstring): the fleet's (`monitor.deploy`), or with
    `deploy` another folder and reload action (a canary's), for the configured registered model."""

    def __init__(self, cfg: DraftopsConfig, deploy: DeployConfig | None = None):
        self.cfg = cfg
        self.deploy = deploy or cfg.monitor.deploy
        self.model = cfg.tracking.registered_model
        self.folder = DeployFolder(Path(self.deploy.dir).resolve())

    def current(self) -> Deployment | None:
        return self.folder.linked(CURRENT)

    def _holds(self, current: Deployment | None, version: str) -> bool:
        """Whether `current` is `version` of this model in the configured format."""
        return current is not None and (current.version, current.format, current.model) == (
            version, self.deploy.format, self.model)

    def serves(self, version: str) -> bool:
        """Whether `current` is `version` in the configured format, and the engine was reloaded onto it."""
        current, state = self.current(), self.folder.read_state()
        return (self._holds(current, version) and state.get("folder") == current.folder.name
                and bool(state.get("reloaded")))

    def ensure(self, champion: str, *, force: bool = False) -> DeployResult:
        """Deploy `champion` unless it is deployed and the engine reloaded (then nothing; a deployment whose reload
        a kill cut short is reloaded). A version whose post-deploy check failed is not deployed again unless
        `force`."""
        folder = self.folder
        folder.own_links()
        current, state = self.current(), folder.read_state()
        if not force and self._holds(current, champion):
            if state.get("folder") == current.folder.name and state.get("reloaded"):
                return DeployResult("none", current)
            self._check_reload()
            with folder.locked():
                result = DeployResult("reload", current, folder.linked(PREVIOUS))
                state = {**state, "version": champion, "folder": current.folder.name, "format": current.format,
                         "reloaded": False, "check": state.get("check", PENDING) if state.get("folder") ==
                         current.folder.name else PENDING, "action": "reload"}
                return self._switch_reload_record(result, state, time.perf_counter())
        if not force and state.get("failed_version") == champion:
            return DeployResult("none", current, notes=[
                f"version {champion} failed its post-deploy check and was rolled back: not deployed again (`draftops "
                "monitor deploy --force` does)"])
        return self.deploy_version(champion, force=force)

    def deploy_version(self, version: str, *, force: bool = False, action: str = "deploy") -> DeployResult:
        """Export (or reuse) `version`, switch `current` to it, reload the engine, record it. With `force` the version
        is exported again into a new folder even where one is kept."""
        start = time.perf_counter()
        self._check_reload()
        with self.folder.locked() as folder:
            fmt = self.deploy.format
            reuse = None if force else next((k for k in folder.kept() if (k.version, k.format, k.model) == (
                version, fmt, self.model)), None)
            result = DeployResult(action, reuse)
            if reuse is None:
                result.deployment = self._export(version, folder.new_folder(version))
                result.exported = True
            result.previous = folder.previous_of(result.deployment)
            state = {"version": version, "folder": result.deployment.folder.name, "format": fmt,
                     "deployed_at": _now(), "action": action, "reloaded": False, "check": PENDING,
                     "previous_version": result.previous.version if result.previous else None}
            return self._switch_reload_record(result, state, start)

    def roll_back(self, reason: str) -> DeployResult:
        """Switch `current` back to `previous` and reload (the registry is left as it is); the version rolled back
        from is remembered as failed, so that it is not deployed again by itself."""
        start = time.perf_counter()
        self._check_reload()
        with self.folder.locked() as folder:
            current, previous = folder.linked(CURRENT), folder.linked(PREVIOUS)
            if previous is None or current is None:
                raise DeployError(f"{folder.root}: no previous deployment to roll back to")
            result = DeployResult("rollback", previous, current, notes=[reason])
            state = {"version": previous.version, "folder": previous.folder.name, "format": previous.format,
                     "deployed_at": _now(), "action": "rollback", "reloaded": False, "check": ROLLED_BACK,
                     "previous_version": current.version, "failed_version": current.version}
            return self._switch_reload_record(result, state, start)

    def record_check(self, outcome: str) -> None:
        """Write the post-deploy check's outcome (VERIFIED or MISMATCH) into deploy.json."""
        state = self.folder.read_state()
        if state and state.get("check") == PENDING:
            self.folder.write_state({**state, "check": outcome, "checked_at": _now()})

    def _export(self, version: str, folder: Path) -> Deployment:
        """Export registered `version` into `folder` in the configured format, then write its manifest (last)."""
        d, cfg = self.deploy, self.cfg
        uri = registry.version_uri(self.model, version)
        try:
            vocabulary = target_gguf(d.gguf_vocabulary or cfg.target) if d.format == "gguf" else None
            vocab_size = folder_vocab_size(cfg.target) if d.format in ("vllm", "speculators") else None
            export_format(draft_source(uri), d.format, folder, force=True, target_vocab_size=vocab_size,
                          vocabulary=vocabulary, gguf_dtype=d.gguf_dtype)
        except (ExportError, registry.RegistryError) as exc:
            raise DeployError(f"export of {uri} as {d.format}: {exc}") from exc
        except OSError as exc:
            raise DeployError(f"deploy step export (of {uri} as {d.format} into {folder}): {exc}") from None
        with step("manifest", str(folder / MANIFEST)):
            files = {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}
            manifest = {"version": version, "format": d.format, "model": self.model, "source": uri,
                        "exported_at": _now(), "files": files}
            write_text_atomic(folder / MANIFEST, json.dumps(manifest, indent=1))
        return read_manifest(folder)

    def _check_reload(self) -> None:
        try:
            check_reload(self.deploy)
        except ReloadError as exc:
            raise DeployError(f"deploy step reload (checked before anything is written): {exc}") from None

    def _switch_reload_record(self, result: DeployResult, state: dict, start: float) -> DeployResult:
        """Plan the reload, write the state (not reloaded), switch, reload, write the state again (reloaded), log the
        run, prune old folders. A reload that fails is logged, then raised as a DeployError."""
        d, folder = result.deployment, self.folder
        values = {"path": str(d.folder), "file": str(d.file), "version": d.version,
                  "current": str(folder.root / CURRENT)}
        try:
            plan = plan_reload(self.deploy, values, {**values, "format": d.format, "model": d.model},
                               f"{d.model}-v{d.version}")
        except ReloadError as exc:
            raise DeployError(f"deploy step reload (planned before the switch): {exc}") from None
        folder.write_state(state)
        folder.switch(d, result.previous)
        try:
            result.notes += plan.run()
            result.reloaded, failure = True, None
        except ReloadError as exc:
            failure = exc
            result.notes.append(f"reload failed: {exc}")  # said once, by whoever catches the DeployError below
        if result.reloaded:
            state["reloaded"] = True
            folder.write_state(state)
        result.seconds = time.perf_counter() - start
        result.run_id = log_deployment(self.cfg, result)
        folder.prune(self.deploy.keep)
        if failure is not None:
            raise DeployError(f"deploy step reload: {failure}; `current` is version {d.version} ({d.folder.name}), "
                              "not reloaded: the next deploy or check reloads it")
        return result


def deploy_champion(cfg: DraftopsConfig, *, force: bool = False) -> DeployResult:
    """The registered champion deployed into the fleet's folder (`Rollout.ensure`): `draftops monitor deploy`."""
    setup_mlflow(cfg)
    return Rollout(cfg).ensure(registry.champion(cfg.tracking.registered_model).version, force=force)


def log_deployment(cfg: DraftopsConfig, result: DeployResult) -> str | None:
    """The deploy as an MLflow run (`draftops-monitor`, run name deploy/rollback/reload) and the version's tags."""
    import mlflow
    from mlflow import MlflowClient

    d = result.deployment
    tags = {M.MONITOR_DECISION_TAG: "DEPLOY", M.DEPLOY_ACTION_TAG: result.action, M.DEPLOY_VERSION_TAG: d.version,
            M.MONITOR_CHAMPION_VERSION_TAG: d.version,
            M.DEPLOY_FOLDER_TAG: str(d.folder), M.DEPLOY_FORMAT_TAG: d.format,
            M.REGISTERED_MODEL_TAG: cfg.tracking.registered_model}
    with start_run(cfg, "monitor", run_name=result.action, tags=tags) as run:
        mlflow.log_params({"deploy.version": d.version, "deploy.folder": str(d.folder), "deploy.format": d.format,
                           "deploy.file": str(d.file)})
        mlflow.log_metrics({"deploy/reloaded": float(result.reloaded), "deploy/exported": float(result.exported),
                            M.seconds("deploy"): result.seconds})
        mlflow.log_dict(result.to_dict(), "deploy/deployment.json")
    client = MlflowClient()
    for tag, value in ((M.DEPLOY_FOLDER_TAG, str(d.folder)), (M.DEPLOY_FORMAT_TAG, d.format),
                       (M.DEPLOYED_AT_TAG, _now()), (M.DEPLOY_RUN_TAG, run.info.run_id)):
        client.set_model_version_tag(d.model, d.version, tag, value)
    return run.info.run_id

"""Deploy the champion to a serving engine: export it into a deploy folder, switch atomically, reload the engine.

Layout of `monitor.deploy.dir`:

    versions/v<N>/          one exported version (`draftops export` in monitor.deploy.format) and its manifest,
                            deployment.json (version, format, files and sizes), written last
    current -> versions/vN  what the engine serves (a relative symlink)
    previous -> versions/vM what it served before (kept for a rollback)
    deploy.json             the last deployment: its folder, whether the engine was reloaded, the post-deploy check

A deploy exports into a folder of its own (through `pipeline.files`: a temporary sibling swapped in), writes the
manifest, points `previous` at the folder `current` points at, then flips `current` (a new symlink renamed over the
old one: one rename, so a reader sees the old target or the new one), then runs the reload action and records it. A
process killed anywhere leaves `current` on a whole deployment, old or new; the next deploy (or check) finishes what
was cut: the engine is reloaded when `current` holds the champion but deploy.json does not say it was. The folder of
a version already exported in the same format is reused (a rollback flips back to it). The newest `keep` folders
are kept, and always `current` and `previous`.

The reload action runs after the switch: `reload_command` (argv, placeholders {path} {file} {version} {current}) and
`reload_url` (an HTTP request with the deployment as its JSON body). Each deploy, and each rollback of a deployment,
is an MLflow run in `draftops-monitor`, and the deployed version carries the folder, format and time as tags.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from filelock import FileLock

from decode.serving.export import ExportError, draft_source, export_format, folder_vocab_size, target_gguf
from pipeline import metrics as M
from pipeline import registry
from pipeline.config import DraftopsConfig
from pipeline.files import recover_dir, write_text_atomic
from pipeline.tracking import setup_mlflow, start_run

log = logging.getLogger("draftops.monitor")

VERSIONS, CURRENT, PREVIOUS = "versions", "current", "previous"
STATE_FILE, MANIFEST = "deploy.json", "deployment.json"
PENDING, VERIFIED, MISMATCH, ROLLED_BACK = "pending", "verified", "mismatch", "rolled_back"


class DeployError(RuntimeError):
    """The champion could not be exported, switched to, or the engine reloaded: the message says which and why."""


@dataclass(frozen=True)
class Deployment:
    """One exported version: what its manifest says, and where it lies."""

    folder: Path
    version: str
    format: str
    model: str
    source: str
    exported_at: str
    files: dict[str, int]

    @property
    def file(self) -> Path:
        """The file an engine loads: the GGUF for the gguf format, else the folder."""
        ggufs = sorted(name for name in self.files if name.endswith(".gguf"))
        return self.folder / ggufs[0] if ggufs else self.folder

    def to_dict(self) -> dict:
        return {**asdict(self), "folder": str(self.folder), "file": str(self.file)}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def root_of(cfg: DraftopsConfig) -> Path:
    return Path(cfg.monitor.deploy.dir).resolve()


def read_manifest(folder: Path) -> Deployment | None:
    """The deployment in `folder`, or None when it is not a whole one (no manifest, or a file missing or resized)."""
    try:
        data = json.loads((folder / MANIFEST).read_text())
        files = {str(k): int(v) for k, v in data["files"].items()}
        if any(not (folder / name).is_file() or (folder / name).stat().st_size != size for name, size in files.items()):
            return None
        return Deployment(folder, str(data["version"]), data["format"], data["model"], data["source"],
                          data["exported_at"], files)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def linked(root: Path, name: str) -> Deployment | None:
    """The deployment behind link `current` or `previous`, or None."""
    link = root / name
    return read_manifest(link.resolve()) if link.is_symlink() else None


def read_state(root: Path) -> dict:
    try:
        return json.loads((root / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}


def write_state(root: Path, state: dict) -> None:
    write_text_atomic(root / STATE_FILE, json.dumps(state, indent=1))


def _point(root: Path, name: str, folder: Path) -> None:
    """Point link `name` at `folder` by renaming a new relative symlink over it (atomic)."""
    tmp = root / f".{name}.tmp{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(os.path.relpath(folder, root), tmp)
    os.replace(tmp, root / name)


def _tidy(root: Path) -> None:
    """Finish or drop what killed deploys left: half-swapped version folders, temporary links."""
    for link in root.glob(".*.tmp*"):
        if link.is_symlink():
            link.unlink()
    versions = root / VERSIONS
    if versions.is_dir():
        names = {f.name.split(".tmp")[0].removesuffix(".old") for f in versions.iterdir()}
        for name in sorted(names):
            recover_dir(versions / name)


def _kept(root: Path) -> list[Deployment]:
    versions = root / VERSIONS
    found = [read_manifest(f) for f in sorted(versions.iterdir())] if versions.is_dir() else []
    return [d for d in found if d is not None]


def _new_folder(root: Path, version: str) -> Path:
    """versions/v<N>, or v<N>-2, ... when that name is taken by the current or previous deployment."""
    busy = {p.resolve() for p in (root / CURRENT, root / PREVIOUS) if p.is_symlink()}
    for i in range(1, 1000):
        folder = root / VERSIONS / (f"v{version}" if i == 1 else f"v{version}-{i}")
        if folder.resolve() not in busy:
            return folder
    raise DeployError(f"{root / VERSIONS}: no free folder name for version {version}")


def export_version(cfg: DraftopsConfig, version: str, folder: Path) -> Deployment:
    """Export registered `version` into `folder` in the configured format, then write its manifest (last)."""
    d, name = cfg.monitor.deploy, cfg.tracking.registered_model
    uri = registry.version_uri(name, version)
    setup_mlflow(cfg)
    try:
        vocabulary = target_gguf(d.gguf_vocabulary or cfg.target) if d.format == "gguf" else None
        vocab_size = folder_vocab_size(cfg.target) if d.format in ("vllm", "speculators") else None
        export_format(draft_source(uri), d.format, folder, force=True, target_vocab_size=vocab_size,
                      vocabulary=vocabulary, gguf_dtype=d.gguf_dtype)
    except (ExportError, registry.RegistryError) as exc:
        raise DeployError(f"export of {uri} as {d.format}: {exc}") from exc
    files = {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}
    manifest = {"version": version, "format": d.format, "model": name, "source": uri, "exported_at": _now(),
                "files": files}
    write_text_atomic(folder / MANIFEST, json.dumps(manifest, indent=1))
    return read_manifest(folder)


def _placeholders(root: Path, deployment: Deployment) -> dict[str, str]:
    return {"path": str(deployment.folder), "file": str(deployment.file), "version": deployment.version,
            "current": str(root / CURRENT)}


def reload_engine(cfg: DraftopsConfig, deployment: Deployment) -> list[str]:
    """Run the configured reload action(s) for `deployment`; what was done, one line each. DeployError on failure."""
    d, root = cfg.monitor.deploy, root_of(cfg)
    values = _placeholders(root, deployment)
    done = []
    if d.reload_command:
        argv = [part.format(**values) for part in d.reload_command]
        try:
            result = subprocess.run(argv, capture_output=True, text=True, timeout=d.reload_timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise DeployError(f"reload command {argv[0]}: {exc}") from None
        if result.returncode != 0:
            tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-5:])
            raise DeployError(f"reload command {' '.join(argv)} exited with {result.returncode}: {tail}")
        done.append(f"ran {' '.join(argv)}")
    if d.reload_url:
        body = json.dumps({**values, "format": deployment.format, "model": deployment.model}).encode()
        request = urllib.request.Request(d.reload_url, data=None if d.reload_method == "GET" else body,
                                         method=d.reload_method, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=d.reload_timeout) as response:
                status = response.status
        except urllib.error.HTTPError as exc:
            raise DeployError(f"reload {d.reload_method} {d.reload_url}: HTTP {exc.code} {exc.reason}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            raise DeployError(f"reload {d.reload_method} {d.reload_url}: {getattr(exc, 'reason', exc)}") from None
        done.append(f"{d.reload_method} {d.reload_url}: HTTP {status}")
    return done


@dataclass
class DeployResult:
    """What a deploy (or a rollback of a deployment) did."""

    action: str  # deploy, rollback, reload, none
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


def _switch(root: Path, deployment: Deployment) -> Deployment | None:
    """Make `deployment` current, the old current previous; returns the new previous."""
    old = linked(root, CURRENT)
    if old is not None and old.folder == deployment.folder:
        return linked(root, PREVIOUS)
    if old is not None:
        _point(root, PREVIOUS, old.folder)
    _point(root, CURRENT, deployment.folder)
    return old


def _reload_and_record(cfg: DraftopsConfig, root: Path, result: DeployResult, state: dict, start: float
                       ) -> DeployResult:
    """Write the state (not reloaded), reload, write it again (reloaded), log the run, prune old folders."""
    d = result.deployment
    write_state(root, state)
    try:
        result.notes += reload_engine(cfg, d)
        result.reloaded = True
    except DeployError as exc:
        result.notes.append(f"reload failed: {exc}; the next deploy or check reloads again")
        log.error("deploy: %s", exc)
    state["reloaded"] = result.reloaded
    write_state(root, state)
    result.seconds = time.perf_counter() - start
    result.run_id = log_deployment(cfg, result)
    _prune(root, cfg.monitor.deploy.keep)
    return result


def deploy_version(cfg: DraftopsConfig, version: str, *, force: bool = False, action: str = "deploy") -> DeployResult:
    """Export (or reuse) `version`, switch `current` to it, reload the engine, record it. With `force` the version is
    exported again into a new folder even where one is kept."""
    start = time.perf_counter()
    root = root_of(cfg)
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / ".deploy.lock")):
        _tidy(root)
        fmt = cfg.monitor.deploy.format
        reuse = None if force else next((k for k in _kept(root) if (k.version, k.format, k.model) == (
            version, fmt, cfg.tracking.registered_model)), None)
        result = DeployResult(action, reuse)
        if reuse is None:
            result.deployment = export_version(cfg, version, _new_folder(root, version))
            result.exported = True
        result.previous = _switch(root, result.deployment)
        state = {"version": version, "folder": result.deployment.folder.name, "format": fmt, "deployed_at": _now(),
                 "action": action, "reloaded": False, "check": PENDING,
                 "previous_version": result.previous.version if result.previous else None}
        return _reload_and_record(cfg, root, result, state, start)


def ensure_deployed(cfg: DraftopsConfig, *, force: bool = False) -> DeployResult:
    """Deploy the champion unless it is deployed and the engine reloaded (then nothing; a deployment whose reload a
    kill cut short is reloaded). A version whose post-deploy check failed is not deployed again unless `force`."""
    root, name = root_of(cfg), cfg.tracking.registered_model
    setup_mlflow(cfg)
    champion = registry.champion(name).version
    current, state = linked(root, CURRENT), read_state(root)
    if not force and current is not None and current.version == champion and current.format == \
            cfg.monitor.deploy.format and current.model == name:
        if state.get("folder") == current.folder.name and state.get("reloaded"):
            return DeployResult("none", current)
        with FileLock(str(root / ".deploy.lock")):
            result = DeployResult("reload", current, linked(root, PREVIOUS))
            state = {**state, "version": champion, "folder": current.folder.name, "format": current.format,
                     "reloaded": False, "check": state.get("check", PENDING) if state.get("folder") ==
                     current.folder.name else PENDING, "action": "reload"}
            return _reload_and_record(cfg, root, result, state, time.perf_counter())
    if not force and state.get("failed_version") == champion:
        return DeployResult("none", current, notes=[
            f"version {champion} failed its post-deploy check and was rolled back: not deployed again (`draftops "
            "monitor deploy --force` does)"])
    return deploy_version(cfg, champion, force=force)


def rollback_deployment(cfg: DraftopsConfig, reason: str) -> DeployResult:
    """Switch `current` back to `previous` and reload (the registry is left as it is); the version rolled back from
    is remembered as failed, so that it is not deployed again by itself."""
    start = time.perf_counter()
    root = root_of(cfg)
    with FileLock(str(root / ".deploy.lock")):
        current, previous = linked(root, CURRENT), linked(root, PREVIOUS)
        if previous is None or current is None:
            raise DeployError(f"{root}: no previous deployment to roll back to")
        _point(root, PREVIOUS, current.folder)
        _point(root, CURRENT, previous.folder)
        result = DeployResult("rollback", previous, current, notes=[reason])
        state = {"version": previous.version, "folder": previous.folder.name, "format": previous.format,
                 "deployed_at": _now(), "action": "rollback", "reloaded": False, "check": ROLLED_BACK,
                 "previous_version": current.version, "failed_version": current.version}
        return _reload_and_record(cfg, root, result, state, start)


def record_check(cfg: DraftopsConfig, outcome: str) -> None:
    """Write the post-deploy check's outcome (VERIFIED or MISMATCH) into deploy.json."""
    root = root_of(cfg)
    state = read_state(root)
    if state and state.get("check") == PENDING:
        write_state(root, {**state, "check": outcome, "checked_at": _now()})


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


def _prune(root: Path, keep: int) -> None:
    """Delete the oldest version folders beyond `keep`; never `current` or `previous`."""
    busy = {p.resolve() for p in (root / CURRENT, root / PREVIOUS) if p.is_symlink()}
    versions = root / VERSIONS
    folders = sorted((f for f in versions.iterdir() if f.is_dir()), key=lambda f: f.stat().st_mtime, reverse=True)
    for folder in folders[keep:]:
        if folder.resolve() not in busy:
            shutil.rmtree(folder, ignore_errors=True)

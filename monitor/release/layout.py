"""The deploy folder on disk (`monitor.deploy.dir`): its layout, its manifests and state, and its links.

    versions/v<N>/          one exported version (`draftops export` in monitor.deploy.format) and its manifest,
                            deployment.json (version, format, files and sizes), written last
    current -> versions/vN  what the engine serves (a relative symlink)
    previous -> versions/vM what it served before (kept for a rollback)
    deploy.json             the last deployment: its folder, whether the engine was reloaded, the post-deploy check

A link is moved by renaming a new symlink over it (one rename, so a reader sees the old target or the new one), and
only while it is a link draftops made (a relative symlink into versions/): a folder or a file put there by hand, or a
link elsewhere, is refused. A write that fails (a read-only or full folder, a lost mount) is a DeployError naming its
step, and leaves no temporary link.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from filelock import FileLock

from pipeline.config import DraftopsConfig
from pipeline.files import recover_dir, write_text_atomic

log = logging.getLogger("draftops.monitor")

VERSIONS, CURRENT, PREVIOUS = "versions", "current", "previous"
STATE_FILE, MANIFEST = "deploy.json", "deployment.json"
PENDING, VERIFIED, MISMATCH, ROLLED_BACK = "pending", "verified", "mismatch", "rolled_back"


class DeployError(RuntimeError):
    """The champion could not be exported, switched to, or the engine reloaded: one line naming the step and why."""


@contextlib.contextmanager
def step(name: str, what: str) -> Iterator[None]:
    """An OSError inside (a read-only or full deploy folder, a lost mount) as a DeployError naming the step."""
    try:
        yield
    except OSError as exc:
        raise DeployError(f"deploy step {name} ({what}): {exc}") from None


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


@dataclass(frozen=True)
class DeployFolder:
    """The deploy folder and what a deploy does to it: read its links and state, lock it, finish what a killed deploy
    left, move a link, prune old versions. Every path below is under `root`."""

    root: Path

    @classmethod
    def of(cls, cfg: DraftopsConfig) -> DeployFolder:
        return cls(Path(cfg.monitor.deploy.dir).resolve())

    def linked(self, name: str) -> Deployment | None:
        """The deployment behind link `current` or `previous`, or None."""
        link = self.root / name
        return read_manifest(link.resolve()) if link.is_symlink() else None

    def read_state(self) -> dict:
        try:
            return json.loads((self.root / STATE_FILE).read_text())
        except (OSError, ValueError):
            return {}

    def write_state(self, state: dict) -> None:
        with step("state", str(self.root / STATE_FILE)):
            write_text_atomic(self.root / STATE_FILE, json.dumps(state, indent=1))

    def point(self, name: str, folder: Path) -> None:
        """Point link `name` at `folder` by renaming a new relative symlink over it (atomic); a failure leaves no
        temporary link."""
        root = self.root
        tmp = root / f".{name}.tmp{os.getpid()}"
        with step("switch", f"{name} -> {os.path.relpath(folder, root)}"):
            try:
                if tmp.is_symlink() or tmp.exists():
                    tmp.unlink()
                os.symlink(os.path.relpath(folder, root), tmp)
                os.replace(tmp, root / name)
            except OSError:
                if tmp.is_symlink():
                    with contextlib.suppress(OSError):
                        tmp.unlink()
                raise

    def switch(self, deployment: Deployment, previous: Deployment | None) -> None:
        """Make `deployment` current and `previous` previous, each link by one rename."""
        if previous is not None and self.linked(PREVIOUS) != previous:
            self.point(PREVIOUS, previous.folder)
        if self.linked(CURRENT) != deployment:
            self.point(CURRENT, deployment.folder)

    def previous_of(self, deployment: Deployment) -> Deployment | None:
        """What `previous` holds once `deployment` is current: the current one, unless it is `deployment` itself."""
        old = self.linked(CURRENT)
        return self.linked(PREVIOUS) if old is not None and old.folder == deployment.folder else old

    def own_links(self) -> None:
        """Refuse a `current` or `previous` that is not a link draftops made (a folder or a file put there by hand, a
        link out of versions/): a deploy replaces only its own links."""
        root = self.root
        for name in (CURRENT, PREVIOUS):
            link = root / name
            if link.is_symlink():
                target = os.readlink(link)
                if os.path.isabs(target) or Path(os.path.normpath(root / target)).parent != root / VERSIONS:
                    raise DeployError(f"{link} points at {target}, not at a folder of {root / VERSIONS}: it is not "
                                      "the link draftops made; move it away (a deploy replaces only its own links)")
            elif link.exists():
                raise DeployError(f"{link} is a {'folder' if link.is_dir() else 'file'}, not the link draftops made: "
                                  "move it away (a deploy replaces only its own links)")

    @contextlib.contextmanager
    def locked(self) -> Iterator[DeployFolder]:
        """The folder under its lock (created with the folder when there is none), its links checked and what killed
        deploys left finished (`own_links`, `tidy`)."""
        with step("lock", str(self.root / ".deploy.lock")):
            self.root.mkdir(parents=True, exist_ok=True)
            lock = FileLock(str(self.root / ".deploy.lock"))
            lock.acquire()
        try:
            self.own_links()
            with step("tidy", str(self.root)):
                self.tidy()
            yield self
        finally:
            lock.release()

    def tidy(self) -> None:
        """Finish or drop what killed deploys left: half-swapped version folders, temporary links."""
        for link in self.root.glob(".*.tmp*"):
            if link.is_symlink():
                link.unlink()
        versions = self.root / VERSIONS
        if versions.is_dir():
            names = {f.name.split(".tmp")[0].removesuffix(".old") for f in versions.iterdir()}
            for name in sorted(names):
                recover_dir(versions / name)

    def kept(self) -> list[Deployment]:
        versions = self.root / VERSIONS
        found = [read_manifest(f) for f in sorted(versions.iterdir())] if versions.is_dir() else []
        return [d for d in found if d is not None]

    def _busy(self) -> set[Path]:
        return {p.resolve() for p in (self.root / CURRENT, self.root / PREVIOUS) if p.is_symlink()}

    def new_folder(self, version: str) -> Path:
        """versions/v<N>, or v<N>-2, ... when that name is taken by the current or previous deployment."""
        busy = self._busy()
        for i in range(1, 1000):
            folder = self.root / VERSIONS / (f"v{version}" if i == 1 else f"v{version}-{i}")
            if folder.resolve() not in busy:
                return folder
        raise DeployError(f"{self.root / VERSIONS}: no free folder name for version {version}")

    def prune(self, keep: int) -> None:
        """Delete the oldest version folders beyond `keep`; never `current` or `previous`."""
        busy = self._busy()
        try:
            folders = sorted((f for f in (self.root / VERSIONS).iterdir() if f.is_dir()),
                             key=lambda f: f.stat().st_mtime, reverse=True)
        except OSError as exc:  # the deployment is done; old folders stay until a later deploy can prune them
            log.warning("deploy: old deployments not pruned: %s", exc)
            return
        for folder in folders[keep:]:
            if folder.resolve() not in busy:
                shutil.rmtree(folder, ignore_errors=True)

"""Registered versions' files on this machine: downloaded once into $DRAFTOPS_HOME/models/registry, checked against
the registry's own listing when they arrive, and checked again each time they are used (every file's size, and its
sha256 where the file changed since the download, against a manifest written once the download was complete). A
damaged copy is downloaded again, as a damaged response cache is generated again; a download that cannot be
completed (a full disk, a store that fails) is an error that says why.
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

from pipeline import draftops_home, registry
from pipeline.files import recover_dir, swap_dir, temporary_sibling
from pipeline.registry import RegisteredVersion, RegistryError

MANIFEST = ".draftops-download.json"
DOWNLOAD_ATTEMPTS = 2
log = logging.getLogger(__name__)


def _cause(message: str) -> str:
    """What an MLflow download error says went wrong: its per-file causes (a full disk), not its headline alone."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    causes = list(dict.fromkeys(line for line in lines[1:] if not line.startswith("#####")))
    return "; ".join(causes[:3]) if causes else (lines[0] if lines else "unknown error")


def download(version: RegisteredVersion, dst: Path) -> Path:
    """Copy the version's files into `dst`; the folder that holds them. RegistryError with the cause otherwise."""
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=version.artifact_uri, dst_path=str(dst)))
    except MlflowException as exc:
        raise RegistryError(f"version {version.version}'s files at {version.artifact_uri} cannot be downloaded: "
                            f"{_cause(exc.message)}") from None
    except OSError as exc:
        raise RegistryError(f"version {version.version}'s files cannot be downloaded to {dst}: {exc}") from None


def listed_sizes(version: RegisteredVersion) -> dict[str, int | None]:
    """Every file of the version as the artifact store lists it (relative path -> bytes; None where the store does
    not say)."""
    from mlflow.exceptions import MlflowException
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    try:
        repository = get_artifact_repository(version.artifact_uri)
        sizes: dict[str, int | None] = {}
        pending: list[str | None] = [None]
        while pending:
            for info in repository.list_artifacts(pending.pop()):
                if info.is_dir:
                    pending.append(info.path)
                else:
                    sizes[info.path] = info.file_size
    except (MlflowException, OSError) as exc:
        raise RegistryError(f"version {version.version}'s files at {version.artifact_uri} cannot be listed: "
                            f"{_cause(str(exc))}") from None
    return sizes


def incomplete(root: Path, sizes: dict[str, int | None]) -> list[str]:
    """How a download in `root` falls short of the listing (missing files, other sizes); empty when it does not."""
    problems = []
    for relative, size in sorted(sizes.items()):
        path = root / relative
        if not path.is_file():
            problems.append(f"{relative} is missing")
        elif size is not None and path.stat().st_size != size:
            problems.append(f"{relative} has {path.stat().st_size} bytes, the registry lists {size}")
    return problems


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(folder: Path) -> None:
    """Record every file of a complete download: size, sha256 and modification time."""
    files = {str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": _sha256(p),
                                          "mtime_ns": p.stat().st_mtime_ns} for p in _files(folder)}
    (folder / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def damage(folder: Path) -> str | None:
    """Why a downloaded copy cannot be used (a file missing, truncated, changed, or no record that the download
    completed), or None when it is intact. Sizes are checked every time, contents where a file's time changed."""
    try:
        recorded = json.loads((folder / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"no record of a complete download ({MANIFEST})"
    if not isinstance(recorded, dict):
        return f"{MANIFEST} is damaged"
    present = {str(p.relative_to(folder)) for p in _files(folder)}
    missing = sorted(set(recorded) - present)
    if missing:
        return f"{missing[0]} is missing"
    for relative, entry in sorted(recorded.items()):
        path = folder / relative
        try:
            stat = path.stat()
            if stat.st_size != entry["size"]:
                return f"{relative} has {stat.st_size} bytes, {entry['size']} were downloaded"
            if stat.st_mtime_ns != entry["mtime_ns"] and _sha256(path) != entry["sha256"]:
                return f"{relative} changed since it was downloaded (sha256)"
        except (OSError, KeyError, TypeError) as exc:
            return f"{relative}: {exc}"
    return None


def registry_checkpoint(source: str, is_checkpoint: Callable[[Path], bool]) -> Path:
    """The local copy of a registered version's checkpoint (downloaded once, keyed by store and location, checked
    every time): the shallowest folder of the download that `is_checkpoint` accepts. RegistryError saying why when it
    cannot be had."""
    version = registry.find_version(source)
    key = hashlib.sha256(f"{registry.store_uri()}|{version.artifact_uri}".encode()).hexdigest()[:12]
    out = draftops_home() / "models" / "registry" / f"{version.name}-v{version.version}-{key}"
    folder = recover_dir(out)
    if folder.is_dir():
        reason = damage(folder)
        if reason is None:
            return out
        log.warning("%s: the local copy in %s is damaged (%s): downloading it again", source, out, reason)
    tmp = temporary_sibling(out)  # two processes resolving the same version each download into their own
    try:
        checkpoint = _download_checked(source, version, tmp, is_checkpoint)
        write_manifest(checkpoint)
        swap_dir(checkpoint, out)
    except OSError as exc:  # a full disk while writing the copy, its manifest or the swap
        raise RegistryError(f"{source}: version {version.version} cannot be written to {out.parent}: {exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _download_checked(source: str, version: RegisteredVersion, tmp: Path,
                      is_checkpoint: Callable[[Path], bool]) -> Path:
    """Download into `tmp` until the copy matches the registry's listing (twice at most); the checkpoint folder."""
    sizes = listed_sizes(version)
    problems: list[str] = []
    for _ in range(DOWNLOAD_ATTEMPTS):
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            root = download(version, tmp)
        except RegistryError as exc:
            raise RegistryError(f"{source}: {exc}") from None
        problems = incomplete(root, sizes)
        if not problems:
            break
        log.warning("%s: incomplete download (%s): downloading again", source, "; ".join(problems[:3]))
    else:
        raise RegistryError(f"{source}: version {version.version}'s download stays incomplete: "
                            f"{'; '.join(problems[:3])}")
    found = sorted(p.parent for p in root.rglob("config.json") if is_checkpoint(p.parent))
    if not found:
        raise RegistryError(f"{source}: version {version.version} at {version.artifact_uri} holds no HF checkpoint "
                            "or speculators export")
    return min(found, key=lambda p: len(p.parts))

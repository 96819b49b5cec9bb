"""One lock per registered model, shared by every process that changes the model (a check with its retraining and
promotion, a rollback, a registration), whatever its working directory."""
from __future__ import annotations

import contextlib
import hashlib
import logging
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout

from pipeline import draftops_home

LOCKS_DIR = ".draftops-locks"
log = logging.getLogger(__name__)
_locks: dict[str, FileLock] = {}  # one lock object per path: reentrant within a thread (a check that registers)


class ModelBusy(RuntimeError):
    """Another process holds the lock of a registered model (a check, a retrain, a promotion, a rollback)."""


def lock_path(name: str, uri: str) -> Path:
    """The lock of registered model `name` in tracking store `uri`: the same file for every process and folder that
    changes that model: beside a sqlite or file store, else (a tracking server) under $DRAFTOPS_HOME/locks, which
    serializes the processes of one machine."""
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme == "sqlite":
        base = Path(parsed.path[1:]).resolve().parent / LOCKS_DIR  # sqlite:///rel.db, sqlite:////abs.db
    elif parsed.scheme in ("", "file"):
        base = Path(parsed.path).resolve() / LOCKS_DIR
    else:
        base = draftops_home() / "locks" / hashlib.sha256(uri.encode()).hexdigest()[:12]
    return base / f"{name}.lock"


@contextlib.contextmanager
def model_lock(name: str, uri: str, *, timeout: float | None = 0.0) -> Iterator[Path]:
    """Hold the lock of registered model `name`; wait up to `timeout` seconds (None: as long as it takes), else raise
    `ModelBusy`. Check, retrain, promotion, rollback and registration all take it."""
    path = lock_path(name, uri)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = _locks.setdefault(str(path), FileLock(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        if timeout == 0:
            raise ModelBusy(f"registered model '{name}' is busy: another process holds {path}") from None
        log.info("waiting for %s (registered model '%s' is busy)", path, name)
        try:
            lock.acquire(timeout=-1 if timeout is None else timeout)
        except Timeout:
            raise ModelBusy(f"registered model '{name}' stayed busy for {timeout:g} s: another process holds "
                            f"{path}") from None
    try:
        yield path
    finally:
        lock.release()

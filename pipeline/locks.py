"""One lock per registered model, shared by every process that changes the model (a check with its retraining and
promotion, a rollback, a registration), whatever its working directory.

No process waits for it without a bound: a check and a rollback give up at once (or after `monitor.lock_timeout`), a
registration or an alias move after `tracking.lock_timeout`, each with one line naming the lock file."""
from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout

from pipeline import draftops_home

LOCKS_DIR = ".draftops-locks"
EXIT_BUSY = 75  # EX_TEMPFAIL: the exit code of a command that found the model busy; try again later
DEFAULT_WAIT = 1800.0  # `tracking.lock_timeout`: seconds a registration waits for a check (with its retraining)
log = logging.getLogger(__name__)
_locks: dict[str, FileLock] = {}  # one lock object per path: reentrant within a thread (a check that registers)
_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


class ModelBusy(RuntimeError):
    """Another process holds the lock of a registered model (a check, a retrain, a promotion, a rollback)."""


def lock_file_name(name: str) -> str:
    """The lock's file name for registered model `name`: the name itself when it is a plain file name, else a safe
    spelling of it with a hash (a name such as `../../x` never reaches outside the lock folder)."""
    if _PLAIN_NAME.fullmatch(name) and ".." not in name:
        return f"{name}.lock"
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._")[:60] or "model"
    return f"{safe}-{hashlib.sha256(name.encode()).hexdigest()[:12]}.lock"


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
    return base / lock_file_name(name)


@contextlib.contextmanager
def model_lock(name: str, uri: str, *, timeout: float = 0.0, then: str = "") -> Iterator[Path]:
    """Hold the lock of registered model `name`; wait up to `timeout` seconds (never without a bound), else raise
    `ModelBusy` with one line (ending with `then`, what the caller can do instead). Check, retrain, promotion,
    rollback and registration all take it."""
    if timeout is None or timeout < 0:
        raise ValueError(f"model_lock needs a finite timeout, not {timeout!r}")
    path = lock_path(name, uri)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = _locks.setdefault(str(path), FileLock(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        if timeout == 0:
            raise ModelBusy(f"registered model '{name}' is busy: another process holds {path}{then}") from None
        log.info("waiting up to %g s for %s (registered model '%s' is busy)", timeout, path, name)
        try:
            lock.acquire(timeout=timeout)
        except Timeout:
            raise ModelBusy(f"registered model '{name}' stayed busy for {timeout:g} s: another process holds "
                            f"{path}{then}") from None
    try:
        yield path
    finally:
        lock.release()

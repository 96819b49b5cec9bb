"""Folders and files written so that a process stopped at any point leaves the old one or the new one, never half of
either.

A writer fills a temporary sibling that only it uses (`temporary_sibling`), then `swap_dir` puts it in place with
renames alone. A reader calls `recover_dir` first: it finishes a swap that was cut between its two renames and
removes the temporary folders of writers that are gone.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

OLD_SUFFIX = ".old"
TMP_SUFFIX = ".tmp"


def temporary_sibling(final: Path) -> Path:
    """An empty folder beside `final` for this process alone (two writers never share one)."""
    tmp = final.with_name(f"{final.name}{TMP_SUFFIX}{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    return tmp


def write_text_atomic(path: Path, text: str) -> Path:
    """Write `text` to a temporary file of this process beside `path`, then rename it over `path`; a write that fails
    (a full or read-only disk) leaves `path` as it was and no temporary file."""
    tmp = path.with_name(f"{path.name}{TMP_SUFFIX}{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    return path


def swap_dir(new: Path, final: Path) -> Path:
    """Put folder `new` in place of `final`: the old `final` is renamed aside, `new` renamed in, the old removed."""
    old = final.with_name(final.name + OLD_SUFFIX)
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(new, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recover_dir(final: Path) -> Path:
    """`final` as the last complete write left it: the old folder back if a swap stopped between its renames, and
    no temporary folders of writers that no longer run."""
    old = final.with_name(final.name + OLD_SUFFIX)
    if old.exists():
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(old, final)
    for tmp in final.parent.glob(f"{final.name}{TMP_SUFFIX}*"):
        pid = tmp.name[len(final.name) + len(TMP_SUFFIX):]
        if not pid.isdigit() or not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)
    return final

"""Run a draftops command with its write boundaries instrumented: count them, or kill -9 the process at one.

    python -m tests.faults.killpoints count OUT.json -- ARGS...       # how often each boundary is crossed, in order
    python -m tests.faults.killpoints kill NAME:N:WHEN -- ARGS...     # SIGKILL at the N-th crossing of NAME

WHEN is `before` (the write never happens), `after` (it happened, nothing after it did) or `torn` (only for
`Path.write_text`: the first half of the text is written). The boundaries are where draftops changes durable state:
renames (every folder swap and atomic file), deletions, plain file writes, and each registry and tracking call.
ARGS are those of `draftops` (pipeline.cli.main).
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import sys
from pathlib import Path

from mlflow import MlflowClient

from pipeline.cli import main as draftops

BOUNDARIES = {
    "os.replace": (os, "replace"),
    "os.rename": (os, "rename"),
    "shutil.rmtree": (shutil, "rmtree"),
    "Path.write_text": (Path, "write_text"),
    "registry.create_model_version": (MlflowClient, "create_model_version"),
    "registry.set_alias": (MlflowClient, "set_registered_model_alias"),
    "registry.delete_alias": (MlflowClient, "delete_registered_model_alias"),
    "registry.set_version_tag": (MlflowClient, "set_model_version_tag"),
    "tracking.log_artifact": (MlflowClient, "log_artifact"),
    "tracking.log_artifacts": (MlflowClient, "log_artifacts"),
    "tracking.log_batch": (MlflowClient, "log_batch"),
    "tracking.set_terminated": (MlflowClient, "set_terminated"),
}


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def instrument(on_cross) -> None:
    """Wrap every boundary: on_cross(name, n, call) runs the n-th crossing of `name` (call() does the write)."""
    counts = dict.fromkeys(BOUNDARIES, 0)
    for name, (owner, attribute) in BOUNDARIES.items():
        original = getattr(owner, attribute)

        def wrapper(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return on_cross(_name, counts[_name], lambda: _original(*args, **kwargs), args)

        setattr(owner, attribute, wrapper)


def count(out: Path) -> None:
    timeline: list[str] = []

    def on_cross(name, n, call, args):
        timeline.append(name)
        return call()

    atexit.register(lambda: out.write_text(json.dumps(timeline)))
    instrument(on_cross)


def kill(spec: str) -> None:
    name, nth, when = spec.split(":")
    torn_elsewhere = when == "torn" and name != "Path.write_text"
    if name not in BOUNDARIES or when not in ("before", "after", "torn") or torn_elsewhere:
        raise SystemExit(f"bad kill point {spec!r}")

    def on_cross(crossed, n, call, args):
        if crossed != name or n != int(nth):
            return call()
        if when == "before":
            die()
        if when == "torn":
            path, text = args[0], args[1]
            with open(path, "w") as f:
                f.write(text[:len(text) // 2])
            die()
        result = call()
        die()
        return result

    instrument(on_cross)


if __name__ == "__main__":
    mode, argument, separator, *command = sys.argv[1:]
    assert separator == "--", "usage: killpoints count|kill ARG -- DRAFTOPS ARGS"
    count(Path(argument)) if mode == "count" else kill(argument)
    sys.exit(draftops(command))

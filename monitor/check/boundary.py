"""The boundary watch (`monitor.engine_boundary`): where the engines report running requests (monitor.fleet.load),
a replica whose window ran more requests at once than the concurrency where speculation stopped paying (the
boundary `draftops engine sweep` measured, read from its engine_sweep.json) is a note in the check's report and a
gauge on the service's /metrics (draftops_monitor_replica_past_boundary). Never a DRIFT: acceptance can hold while
the draft costs throughput, and what to do (a batch-size rule, fewer draft tokens) is the serving team's call."""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from monitor.fleet.load import read_load
from pipeline.config import DraftopsConfig


def boundary_of(path: str) -> int | None:
    """The boundary concurrency in a sweep's result file; None when speculation paid at every concurrency swept."""
    try:
        value = json.loads(Path(path).read_text()).get("boundary_concurrency")
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"monitor.engine_boundary {path}: not an engine sweep's result ({exc})") from None
    return None if value is None else int(value)


def watch(cfg: DraftopsConfig, report, *, load: Callable = read_load, now: float | None = None) -> None:
    """Each replica's running requests against the boundary: `report.load` ({replica: [running, past]}) and a note
    for each replica past it."""
    path = cfg.monitor.engine_boundary
    if not path or report.server is None:
        return
    try:
        boundary = boundary_of(path)
    except ValueError as exc:
        report.decision.notes.append(str(exc))
        return
    loads, error = load(cfg, time.time() if now is None else now)
    if error:
        report.decision.notes.append(f"boundary watch: running requests not read: {error}")
    for name, reading in sorted(loads.items()):
        if reading.running is None:
            continue
        past = boundary is not None and reading.running > boundary
        report.load[name] = [reading.running, past]
        if past:
            report.decision.notes.append(
                f"replica {name}: {reading.running:.1f} requests running at once over its window, past concurrency "
                f"{boundary} where speculation stopped paying in the engine sweep ({path}): the draft may cost "
                "throughput there (acceptance is not the question)")

"""The boundary watch (`monitor.engine_boundary`): where the engines report running requests (monitor.fleet.load),
a replica whose window ran more requests at once than the concurrency where speculation stopped paying (the
boundary `draftops engine sweep` measured, read from its engine_sweep.json) is a note in the check's report and a
gauge on the service's /metrics (draftops_monitor_replica_past_boundary). Never a DRIFT: acceptance can hold while
the draft costs throughput, and what to do (a batch-size rule, fewer draft tokens) is the serving team's call."""
from __future__ import annotations

import json
from pathlib import Path

from monitor.fleet.load import EngineLoad
from pipeline.config import DraftopsConfig


def boundary_of(path: str) -> int | None:
    """The boundary concurrency in a sweep's result file; None when speculation paid at every concurrency swept."""
    try:
        value = json.loads(Path(path).read_text()).get("boundary_concurrency")
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"monitor.engine_boundary {path}: not an engine sweep's result ({exc})") from None
    return None if value is None else int(value)


def watch(cfg: DraftopsConfig, report, reading: tuple[dict[str, EngineLoad], str | None] | None) -> None:
    """Each replica's running requests (`reading`: monitor.fleet.load.read_load's, None when not read) against the
    boundary: `report.load` ({replica: [running, past]}) and a note for each replica past it."""
    path = cfg.monitor.engine_boundary
    if not path or reading is None:
        return
    try:
        boundary = boundary_of(path)
    except ValueError as exc:
        report.decision.notes.append(str(exc))
        return
    loads, error = reading
    if error:
        report.decision.notes.append(f"boundary watch: running requests not read: {error}")
    for name, load in sorted(loads.items()):
        if load.running is None:
            continue
        past = boundary is not None and load.running > boundary
        report.load[name] = [load.running, past]
        if past:
            report.decision.notes.append(
                f"replica {name}: {load.running:.1f} requests running at once over its window, past concurrency "
                f"{boundary} where speculation stopped paying in the engine sweep ({path}): the draft may cost "
                "throughput there (acceptance is not the question)")

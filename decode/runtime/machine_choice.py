"""Choices made by timing candidates on this machine, and what they share: which machine this is (`machine_key`), its
CPU's instruction sets (`cpu_flags`, `bf16_units`), whether it is too busy to time on (`machine_busy`), timing
candidates against each other (`interleaved_minimums`) and the one cache of what was measured (`measured`).

It is apart so that its clients say what they time and nothing else: `decode.runtime.kernels` (`cpu_linear: auto`),
`distill.precision` (`distill.generation_dtype` and `distill.mixed_precision: auto`) and
`decode.tree_budget_measured` (`decode.tree_budget_schedule: auto`). How it times and caches, and the busy-machine
rule: docs/concepts.md#choices-timed-on-this-machine.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from pipeline import draftops_home
from pipeline.files import write_text_atomic

PROC = Path("/proc")
UNSAVED: dict[Path, dict[str, Any]] = {}  # cache file -> items measured on a busy machine, for this process only
ONCE = "value"  # the one item of a choice measured as a whole (`measured_once`)


class BusyMachineWarning(UserWarning):
    """A choice was timed while the machine was busy (`machine_busy`)."""


def cpu_model_name() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (Linux), else what `platform` knows."""
    try:
        for line in (PROC / "cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def cpu_flags() -> set[str]:
    """The instruction-set flags of this CPU (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        text = (PROC / "cpuinfo").read_text()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), set())


def amx_bf16_usable() -> bool:
    """Whether this CPU has AMX's bf16 tile units and Linux grants this process their state (torch asks for it; a
    VM may report the flag and still refuse)."""
    return "amx_bf16" in cpu_flags() and bool(torch._C._cpu._init_amx())


def bf16_units() -> list[str]:
    """This CPU's bf16 instruction sets that torch can use: "avx512_bf16", "amx_bf16" (where usable). Where there are
    none, fp32 is the only candidate and no precision is timed."""
    flags = cpu_flags()
    units = [name for name in ("avx512_bf16",) if name in flags]
    if "amx_bf16" in flags and amx_bf16_usable():
        units.append("amx_bf16")
    return units


def machine_key() -> dict:
    """What every timing holds for: this CPU, this torch, this many threads."""
    return {"cpu": cpu_model_name(), "torch": torch.__version__, "threads": torch.get_num_threads()}


def _thread_state(stat: Path) -> str:
    """A thread's scheduler state from its /proc stat line ("R": running or runnable); its name may hold spaces or
    parentheses, so the state is read after the last ")"."""
    return stat.read_text().rpartition(")")[2].split()[0]


def runnable_elsewhere(reads: int = 5, interval: float = 0.02) -> int | None:
    """How many threads of other processes are running or waiting for a CPU now: the kernel's count of runnable threads
    (/proc/loadavg) less this process's own, the least of a few reads `interval` apart (a job that holds a core shows in
    every read, a blip in one). None where /proc does not tell (not Linux)."""
    counts = []
    for _ in range(reads):
        try:
            runnable = int((PROC / "loadavg").read_text().split()[3].split("/")[0])
            own = sum(_thread_state(stat) == "R" for stat in (PROC / "self" / "task").glob("*/stat"))
        except (OSError, ValueError, IndexError):
            return None
        counts.append(runnable - own)
        time.sleep(interval)
    return max(0, min(counts))


def machine_busy() -> str | None:
    """Why timings measured now would mislead ("1 other runnable thread on 2 CPUs"), or None: other processes hold
    half the CPUs or more. This process's own threads do not count: the load average would, and reads a job's own
    finished generation as load. Without /proc: the 1-minute load average above the CPU count."""
    cpus = os.cpu_count() or 1
    others = runnable_elsewhere()
    if others is not None:
        return f"{others} other runnable thread{'s' * (others != 1)} on {cpus} CPUs" if others >= max(1, cpus // 2) \
            else None
    try:
        load = os.getloadavg()[0]
    except OSError:  # not available on this platform
        return None
    return f"load {load:.1f} on {cpus} CPUs" if load > cpus else None


# interleaved_minimums: how long candidates are timed
WARMUP = 1  # an untimed turn first: oneDNN creates its primitive, pages are touched
REPS = 31  # timed turns at most ...
MIN_REPS = 3  # ... and at least, however long they take
BUDGET_S = 0.15  # seconds of timed turns after which the measurement stops at MIN_REPS or beyond


def interleaved_minimums(calls: Sequence[Callable[[], object]], *, reps: int = REPS, min_reps: int = MIN_REPS,
                         budget_s: float = BUDGET_S, clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Fastest seconds of each call, timed in turns (a, b, a, b, ...) so that load on the machine hits them alike:
    WARMUP untimed turns, then `reps` timed ones, or fewer (not under `min_reps`) once `budget_s` has passed.
    Other load only ever adds time, so the minimum is the estimate a busy machine distorts least (a median picks the
    wrong candidate where another job holds a core)."""
    for _ in range(WARMUP):
        for call in calls:
            call()
    times: list[list[float]] = [[] for _ in calls]
    start = clock()
    for turn in range(reps):
        if turn >= min_reps and clock() - start > budget_s:
            break
        for call, seconds in zip(calls, times):
            begin = clock()
            call()
            seconds.append(clock() - begin)
    return [min(seconds) for seconds in times]


def _plain(value: Any) -> Any:
    """`value` as it reads back from JSON (tuples as lists, keys as strings)."""
    return json.loads(json.dumps(value, sort_keys=True))


def cache_file(choice: str, scope: Mapping, timed: bool = True) -> Path:
    """$DRAFTOPS_HOME/machine_choice/<choice>/<cpu>_torch-<version>_<threads>-threads_<scope digest>.json (without
    the machine for a measurement that is no timing: `measured`'s `timed`)."""
    name = hashlib.sha256(json.dumps(_plain(scope), sort_keys=True).encode()).hexdigest()[:16]
    if timed:
        key = machine_key()
        name = f"{key['cpu']}_torch-{key['torch']}_{key['threads']}-threads_{name}"
    return draftops_home() / "machine_choice" / choice / (re.sub(r"[^A-Za-z0-9.+_-]+", "-", name) + ".json")


def read_items(path: Path, machine: dict | None, scope: Mapping) -> dict[str, Any]:
    """The items cached in `path` for `machine` and `scope`; empty if the file is missing, unreadable or for another
    machine or scope."""
    try:
        data = json.loads(path.read_text())
        if data["machine"] != machine or data["scope"] != _plain(scope) or not isinstance(data["items"], dict):
            return {}
        return data["items"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _parsed(items: Mapping[str, Any], wanted: Sequence[str], parse: Callable[[Any], Any]) -> dict[str, Any]:
    """`parse` of each wanted item present; an item it refuses counts as missing."""
    out = {}
    for name in wanted:
        if name in items:
            try:
                out[name] = parse(items[name])
            except (ValueError, KeyError, TypeError, IndexError):
                pass
    return out


def measured(choice: str, scope: Mapping, items: Sequence[str], measure: Callable[[str], Any], *,
             parse: Callable[[Any], Any] = lambda value: value, pins_output: bool = False,
             timed: bool = True) -> dict[str, Any]:
    """Each of `items` (names) -> `parse` of its measurement: cached for this machine, `choice` and `scope`, and
    measured (`measure(name)`, a JSON-able value) where the cache lacks it, then cached. A file that cannot be read
    counts as empty and an item `parse` refuses as missing: they are measured again; files are written whole.

    The busy-machine rule: while other processes hold half the CPUs or more, a multi-threaded candidate waits for its
    descheduled threads, and that wait would decide a choice cached for good. So a busy machine's timings serve this
    process only (`UNSAVED`) and a later process measures again, unless `pins_output`: a choice that decides what a
    job produces (the precisions of a distill job) is cached from its first measurement, busy or not, since a killed
    job's rerun must produce exactly what the first run did (tests/faults compares them) and a close choice timed again
    could flip. `timed` False: a measurement that is no timing (a replay's acceptance) is keyed by its scope alone and
    cached whatever the load."""
    path = cache_file(choice, scope, timed)
    machine = machine_key() if timed else None
    found = _parsed({**read_items(path, machine, scope), **UNSAVED.get(path, {})}, items, parse)
    missing = [name for name in dict.fromkeys(items) if name not in found]
    if not missing:
        return found
    new = {name: _plain(measure(name)) for name in missing}
    busy = machine_busy() if timed else None
    if busy and not pins_output:
        warnings.warn(f"{choice}: timed on a busy machine ({busy}); used by this process and not cached, so a "
                      "quieter run times it again", BusyMachineWarning, stacklevel=2)
        UNSAVED.setdefault(path, {}).update(new)
    else:
        if busy:
            warnings.warn(f"{choice}: timed on a busy machine ({busy}); cached in {path} all the same (it decides "
                          "what the job produces, and a rerun must produce the same): delete it to time again",
                          BusyMachineWarning, stacklevel=2)
        path.parent.mkdir(parents=True, exist_ok=True)
        # read again: another process may have added items meanwhile
        stored = {**read_items(path, machine, scope), **new}
        write_text_atomic(path, json.dumps({"machine": machine, "scope": _plain(scope), "items": stored}, indent=1))
    return {**found, **{name: parse(value) for name, value in new.items()}}


def measured_once(choice: str, scope: Mapping, measure: Callable[[], Any], **options) -> Any:
    """`measured` for a choice measured as a whole (one item): its parsed measurement."""
    return measured(choice, scope, [ONCE], lambda _: measure(), **options)[ONCE]

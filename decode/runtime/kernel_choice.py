"""What `cpu_linear: auto` rests on: per weight shape and row count, how long torch's `F.linear` and oneDNN's packed
product take on this machine, measured once and cached.

The measurement itself (`decode.runtime.kernels.measure_linear`) times the two kernels in turns and keeps each one's
fastest call (`interleaved_minimums`): other load on the machine only ever adds time, so the minimum is the estimate of
the kernel's own cost that a busy machine distorts least (a median picked the wrong kernel where another job held a
core). Its results are cached as JSON under `$DRAFTOPS_HOME/cpu_linear/`, one file per machine key: the CPU's model
name, the torch version and torch's thread count, the three things the comparison depends on. The first load of a model
on a machine measures the shapes the cache lacks and adds them; later loads read the file. A file that cannot be read
(corrupt, another key, rows measured differently) counts as empty: its shapes are measured again and it is rewritten
atomically.
"""
from __future__ import annotations

import json
import os
import platform
import re
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pipeline import draftops_home
from pipeline.files import write_text_atomic

# The row counts measured: 1 (decoding), the widths of speculative verifies (γ + 1 for small γ) and a generation
# batch. A product of n rows runs the kernel picked at the largest of these that is <= n
# (`decode.runtime.kernels.AutoLinear`).
ROWS = (1, 2, 4, 6, 8, 64)
Shape = tuple[int, int]  # a linear layer's weight: (out_features, in_features)


@dataclass(frozen=True)
class Timing:
    """Milliseconds of one product of `rows` rows with each kernel (the fastest of the timed calls)."""

    rows: int
    torch_ms: float
    onednn_ms: float

    @property
    def pick(self) -> str:
        """The faster kernel ("torch" on a tie: it needs no packed copy of the weight)."""
        return "onednn" if self.onednn_ms < self.torch_ms else "torch"


def cpu_model_name() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (Linux), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def cpu_flags() -> set[str]:
    """The instruction-set flags of this CPU (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), set())


def amx_bf16_usable() -> bool:
    """Whether this CPU has AMX's bf16 tile units and Linux grants this process their state (torch asks for it; a
    VM may report the flag and still refuse): bf16 products of many rows then run on the tiles, several times faster
    than fp32 ones (docs/concepts.md#the-cpu-runtime)."""
    return "amx_bf16" in cpu_flags() and bool(torch._C._cpu._init_amx())


def machine_key() -> dict:
    """What the measured timings hold for: this CPU, this torch, this many threads."""
    return {"cpu": cpu_model_name(), "torch": torch.__version__, "threads": torch.get_num_threads()}


def cache_file(key: dict) -> Path:
    """$DRAFTOPS_HOME/cpu_linear/<cpu>_torch-<version>_<threads>-threads.json"""
    name = f"{key['cpu']}_torch-{key['torch']}_{key['threads']}-threads"
    return draftops_home() / "cpu_linear" / (re.sub(r"[^A-Za-z0-9.+_-]+", "-", name) + ".json")


def read_cache(path: Path, key: dict) -> dict[Shape, list[Timing]]:
    """The timings cached in `path` for `key`; empty if the file is missing, unreadable, for another key, or holds
    other row counts than ROWS (then every shape is measured again)."""
    try:
        data = json.loads(path.read_text())
        if data["key"] != key:
            return {}
        cached = {}
        for name, rows in data["shapes"].items():
            out_features, in_features = (int(n) for n in name.split("x"))
            timings = [Timing(int(t["rows"]), float(t["torch_ms"]), float(t["onednn_ms"])) for t in rows]
            if tuple(t.rows for t in timings) == ROWS:
                cached[(out_features, in_features)] = timings
        return cached
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def write_cache(path: Path, key: dict, timings: dict[Shape, list[Timing]]) -> None:
    """Write the file whole or not at all: into a temporary sibling of this process, then renamed over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"key": key, "shapes": {f"{o}x{i}": [asdict(t) for t in ts] for (o, i), ts in sorted(timings.items())}}
    write_text_atomic(path, json.dumps(data, indent=1))


class BusyMachineWarning(UserWarning):
    """Kernel timings were measured while the machine was busy: used for this process, not cached."""


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
            runnable = int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
            own = sum(_thread_state(stat) == "R" for stat in Path("/proc/self/task").glob("*/stat"))
        except (OSError, ValueError, IndexError):
            return None
        counts.append(runnable - own)
        time.sleep(interval)
    return max(0, min(counts))


def machine_busy() -> str | None:
    """Why timings measured now would mislead ("1 other runnable thread on 2 CPUs"), or None. While other processes
    hold half the CPUs or more, a multi-threaded product waits for its descheduled threads, and that wait, not the
    kernel, would decide a pick that is then cached for good. This process's own threads do not count: the load
    average would, and reads a job's own finished generation as load. Without /proc: the 1-minute load average above
    the CPU count."""
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


def shape_timings(shapes: Iterable[Shape], measure: Callable[[Shape], list[Timing]]) -> dict[Shape, list[Timing]]:
    """Timings at ROWS for each shape: from this machine's cache file, measuring (by `measure`) the shapes it lacks
    and adding them to the file, unless the machine is busy (`machine_busy`): then they serve this process only."""
    shapes, key = list(shapes), machine_key()
    path = cache_file(key)
    cached = read_cache(path, key)
    missing = sorted(set(shapes) - set(cached))
    if missing:
        cached.update({shape: measure(shape) for shape in missing})
        busy = machine_busy()
        if busy:
            warnings.warn(f"cpu_linear auto: kernels timed on a busy machine ({busy}); the picks are used now and "
                          f"not cached, so a quieter load measures again", BusyMachineWarning, stacklevel=2)
        else:
            write_cache(path, key, cached)
    return {shape: cached[shape] for shape in shapes}

"""Whether the target generates its training responses faster in bfloat16 on this CPU: measured once per CPU and
generation batch, cached like `cpu_linear: auto` (`decode.runtime.kernel_choice`).

A CPU with bf16 units (AVX512_BF16, as on AMD Zen 4 and Intel Cooper Lake and later; or AMX-BF16, where Linux grants
this process its tile state) may multiply bf16 matrices several times faster than fp32 ones, and a generation step's
products have as many rows as the generation batch. Whether it does for this model's shapes depends on the CPU and
torch's kernels, so it is measured rather than read from one instruction set: for each weight shape of the model's
linear layers, a product of `rows` rows in fp32 (the faster of torch's and oneDNN's packed kernel, what `cpu_linear:
auto` would run) against the same product in bf16, the fastest of interleaved calls (`interleaved_minimums`: load on
the machine only adds time). bf16 is picked when the model's whole step (each shape's time times its layer count)
is faster. A CPU without bf16 units is not measured: fp32.

The timings are cached as JSON under `$DRAFTOPS_HOME/generation_dtype/`, one file per machine key and row count;
timings taken on a busy machine are cached too, with a warning (`machine_busy`): the pick decides the training data,
so it must not change between a killed job and its re-run.
"""
from __future__ import annotations

import itertools
import json
import re
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from decode.runtime.kernel_choice import (
    BusyMachineWarning,
    Shape,
    amx_bf16_usable,
    cpu_flags,
    machine_busy,
    machine_key,
)
from decode.runtime.kernels import MAX_COPIES, STREAM_BYTES, linear_shapes, onednn_linear, pack_weight
from decode.runtime.timing import interleaved_minimums
from pipeline import draftops_home
from pipeline.files import write_text_atomic


def bf16_units() -> list[str]:
    """This CPU's bf16 instruction sets that torch can use: "avx512_bf16", "amx_bf16" (where usable)."""
    flags = cpu_flags()
    units = [name for name in ("avx512_bf16",) if name in flags]
    if "amx_bf16" in flags and amx_bf16_usable():
        units.append("amx_bf16")
    return units


def cache_file(key: dict, rows: int) -> Path:
    """$DRAFTOPS_HOME/generation_dtype/<cpu>_torch-<version>_<threads>-threads_<rows>-rows.json"""
    name = f"{key['cpu']}_torch-{key['torch']}_{key['threads']}-threads_{rows}-rows"
    return draftops_home() / "generation_dtype" / (re.sub(r"[^A-Za-z0-9.+_-]+", "-", name) + ".json")


def measure_shape(shape: Shape, rows: int) -> tuple[float, float]:
    """(fp32 ms, bf16 ms) of one product of `rows` rows with a weight of `shape`: fp32 the faster of F.linear and
    oneDNN on a packed weight, each call on the next of enough weight copies to stream them from memory."""
    out_features, in_features = shape
    copies = max(1, min(MAX_COPIES, -(-STREAM_BYTES // (4 * out_features * in_features))))
    weights = [torch.randn(shape) for _ in range(copies)]
    packed = [pack_weight(w) for w in weights]
    halves = [w.bfloat16() for w in weights]
    x = torch.randn(rows, in_features)
    x16 = x.bfloat16()
    plain, blocked, bf16 = itertools.cycle(weights), itertools.cycle(zip(weights, packed)), itertools.cycle(halves)

    def onednn_call():
        weight, packed_weight = next(blocked)
        return onednn_linear(x, weight, None, packed_weight)

    with torch.inference_mode():
        torch_s, onednn_s, bf16_s = interleaved_minimums(
            [lambda: F.linear(x, next(plain)), onednn_call, lambda: F.linear(x16, next(bf16))])
    return round(min(torch_s, onednn_s) * 1e3, 4), round(bf16_s * 1e3, 4)


def read_cache(path: Path, key: dict) -> dict[Shape, tuple[float, float]]:
    try:
        data = json.loads(path.read_text())
        if data["key"] != key:
            return {}
        return {tuple(int(n) for n in name.split("x")): (float(t[0]), float(t[1]))
                for name, t in data["shapes"].items()}
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return {}


def shape_timings(shapes: list[Shape], rows: int) -> dict[Shape, tuple[float, float]]:
    """(fp32 ms, bf16 ms) per shape at `rows`: from this machine's cache file, measuring (and adding) those it lacks.
    Cached even when timed on a busy machine (with a warning): unlike a kernel pick, the precision decides the
    training data, and a killed job's re-run must generate it as the first run did."""
    key = machine_key()
    path = cache_file(key, rows)
    cached = read_cache(path, key)
    missing = sorted(set(shapes) - set(cached))
    if missing:
        cached.update({shape: measure_shape(shape, rows) for shape in missing})
        busy = machine_busy()
        if busy:  # cached all the same: the precision decides the training data, so a re-run must pick the same one
            warnings.warn(f"generation_dtype auto: timed on a busy machine ({busy}); cached in {path} all the same "
                          "(a killed job's re-run must generate in the same precision): delete it to time again",
                          BusyMachineWarning, stacklevel=2)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps({"key": key, "rows": rows, "shapes": {
            f"{o}x{i}": list(t) for (o, i), t in sorted(cached.items())}}, indent=1))
    return {shape: cached[shape] for shape in shapes}


def step_costs(model: torch.nn.Module, rows: int) -> tuple[float, float]:
    """(fp32 ms, bf16 ms) of the products of one step of `rows` rows through every linear layer of `model`."""
    counts = linear_shapes(model)
    timings = shape_timings(sorted(counts), rows)
    return (sum(counts[s] * timings[s][0] for s in counts), sum(counts[s] * timings[s][1] for s in counts))


def generation_dtype(model: torch.nn.Module, rows: int) -> torch.dtype:
    """The dtype the target should generate in: bfloat16 for an fp32 CPU model on a CPU with bf16 units where its
    step of `rows` rows measures faster in bfloat16 (`step_costs`), else the model's own."""
    dtype = next(model.parameters()).dtype
    if next(model.parameters()).device.type != "cpu" or dtype != torch.float32 or not bf16_units():
        return dtype
    fp32_ms, bf16_ms = step_costs(model, rows)
    return torch.bfloat16 if bf16_ms < fp32_ms else dtype

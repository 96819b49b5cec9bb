"""Wall-clock timing of decoding on a shared machine: one call timed with the device synchronized, and several
decoding methods timed on the same prompts in interleaved order (used by `draftops bench` and `draftops sweep`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch


def timed(fn: Callable[[], object], device: torch.device) -> tuple[object, float]:
    """(fn(), seconds it took), with CUDA synchronized before and after so queued kernels count where they ran."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - start


@dataclass
class Interleaved:
    """Per method, in prompt order: what each run returned and the seconds it took."""

    outputs: dict[Hashable, list]
    seconds: dict[Hashable, list[float]]


def run_interleaved(methods: Mapping[Hashable, Callable[[list[int]], object]], prompts: Sequence[list[int]],
                    device: torch.device) -> Interleaved:
    """Run every method on every prompt, timed; the methods take turns prompt by prompt in an order that rotates by
    one each prompt, so that load on the machine hits them alike."""
    names = list(methods)
    outputs: dict[Hashable, list] = {name: [] for name in names}
    seconds: dict[Hashable, list[float]] = {name: [] for name in names}
    for i, prompt in enumerate(prompts):
        for name in names[i % len(names):] + names[: i % len(names)]:
            out, s = timed(lambda: methods[name](prompt), device)
            outputs[name].append(out)
            seconds[name].append(s)
    return Interleaved(outputs, seconds)

"""The sweep's two other axes: the batch size (B sequences decoded together, predicted from batched step costs
and decoded for real at small B) and quantization (the int8 target, and llama.cpp's, beside speculation)."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from decode.measure.batched import batched_greedy, batched_speculative
from decode.measure.quantized import int8_dynamic, quantization_quality
from decode.measure.sweep_acceptance import at_context
from decode.measure.sweep_drafts import Draft
from decode.measure.sweep_prediction import predict_batches
from decode.runtime.forward import ModelRunner, greedy_decode
from decode.runtime.timing import run_interleaved
from decode.serving.llamacpp import LlamaServer, optional_rows, served_target
from decode.step_costs import measure_batch_costs
from pipeline.intervals import paired_speedup

BATCHES = (1, 2, 4, 8, 16, 32)  # batch sizes of the batch axis


BATCH_CONTEXT = 512  # the context length of every sequence of the batch axis


MEASURED_BATCH_MAX = 4  # batch sizes up to this one are also decoded for real (`measure_batches`)


def measure_batches(target_model, draft: Draft, rows: list[dict], prompts: Sequence[list[int]],
                    batches: Sequence[int], new_tokens: int) -> list[dict]:
    """Decode a batch for real at each of `batches` (`decode.measure.batched`): B of `prompts` (cycled; all of one
    length), the target alone and with `draft` at the γ the batch axis predicted best for it at B (`rows`), one after
    the other in an order that alternates by B; the speedup of the decoding after the prefill, beside the prediction."""
    measured = []
    predicted = {r["batch"]: r for r in rows if r["draft"] == draft.name}
    for i, b in enumerate(batches):
        group = [prompts[j % len(prompts)] for j in range(b)]
        gamma = predicted[b]["gamma"]
        runs = {"target_only": lambda: batched_greedy(target_model, group, new_tokens),
                "speculative": lambda: batched_speculative(target_model, draft.model, group, new_tokens, gamma,
                                                           draft_token_ids=draft.token_ids)}
        done = {name: runs[name]() for name in (list(runs) if i % 2 == 0 else list(runs)[::-1])}
        (alone, alone_stats), (spec, spec_stats) = done["target_only"], done["speculative"]
        speedup = alone_stats["decode_s"] / spec_stats["decode_s"]
        measured.append({"draft": draft.name, "batch": b, "gamma": gamma, "new_tokens": new_tokens,
                         "measured_speedup": speedup, "predicted_speedup": predicted[b]["predicted_speedup"],
                         "gap": speedup / predicted[b]["predicted_speedup"] - 1,
                         "acceptance": spec_stats["accepted"] / spec_stats["drafted"],
                         "same_output_as_target": sum(a == s for a, s in zip(alone, spec)),
                         "target_only_s": alone_stats["decode_s"], "speculative_s": spec_stats["decode_s"]})
    return measured


def batch_axis(model, drafts: Sequence[Draft], costs: dict, acceptance: dict, prompts: Sequence[list[int]],
               filler: list[int], *, batches: Sequence[int], gammas: Sequence[int], lengths: Sequence[int], reps: int,
               phase: Callable[[str, str], None]) -> dict:
    """The batch axis at the context length of `prompts` (all of one length): costs by batch size
    (`decode.step_costs.measure_batch_costs`), each draft's predicted speedup by batch size (`predict_batches`,
    steady state over the longest generation length), and the batches up to MEASURED_BATCH_MAX decoded for real
    (`measure_batches`, the middle generation length) with the draft model predicted best at the smallest batch."""
    context = len(prompts[0])
    phase("batch", f"batch costs at B = {list(batches)}, context {context}")
    batch_costs = measure_batch_costs(model, {d.name: d.model for d in drafts if d.is_model},
                                      at_context([], filler, context + max(gammas) + 1), context, batches,
                                      range(2, max(gammas) + 2), reps=reps)
    batch = {"costs": batch_costs, "measured": [],
             **predict_batches(batch_costs, costs, acceptance, [d.name for d in drafts if not d.is_model], gammas,
                               max(lengths))}
    candidates = [d for d in drafts if d.grows_trees and d.name in batch_costs["drafts"]]
    real = [b for b in batches if b <= MEASURED_BATCH_MAX]
    if candidates and real:
        at_smallest = {r["draft"]: r["predicted_speedup"] for r in batch["rows"] if r["batch"] == batches[0]}
        best = max(candidates, key=lambda d: at_smallest[d.name])
        middle = lengths[len(lengths) // 2]
        phase("batch_measured", f"decoding batches of {real} for real with {best.name}, {middle} tokens")
        batch["measured"] = measure_batches(model, best, batch["rows"], prompts, real, middle)
    return batch


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two outputs share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def llama_cpp_target_server(mode: str, target: str, log: Path, stack: contextlib.ExitStack
                            ) -> tuple[LlamaServer | None, str | None]:
    """llama-server on the target's GGUF for the quantization rows, or (None, why not), by `mode` as
    `decode.serving.llamacpp.optional_rows` takes it; it stops when `stack` closes."""
    return optional_rows(mode, lambda: stack.enter_context(
        LlamaServer(served_target(target), threads=torch.get_num_threads(), log=log)))


def measure_quantization(target_model, draft: Draft, gamma: int, prompts: Sequence[list[int]], new_tokens: int,
                         quality_prompts: Sequence[list[int]], quality_responses: Sequence[list[int]], *,
                         llama_cpp: LlamaServer | None = None, seed: int = 0) -> dict:
    """The target quantized instead of drafted for: the fp32 target alone, its int8 copy alone
    (`decode.measure.quantized.int8_dynamic`), llama.cpp on the target's GGUF where `llama_cpp` is given (a started
    server; its own quantized kernels), and the speculative decoder with `draft` at γ, interleaved on `prompts` (each
    generating `new_tokens`, EOS ignored), with speedups against the fp32 target alone; how many outputs each shares
    with it; and the int8 target's quality on the quality prompts' fp32 greedy responses
    (`decode.measure.quantized.quantization_quality`).
    """
    device = next(target_model.parameters()).device
    quantized = int8_dynamic(target_model)
    runner, int8_runner = ModelRunner(target_model), ModelRunner(quantized)
    decoder = draft.decoder(target_model, gamma)
    methods = {"target_only": lambda p: greedy_decode(runner, p, new_tokens),
               "int8_target_only": lambda p: greedy_decode(int8_runner, p, new_tokens),
               "speculative": lambda p: decoder.generate(p, max_new_tokens=new_tokens).token_ids}
    if llama_cpp is not None:
        methods["llama_cpp_target_only"] = lambda p: llama_cpp.complete(p, new_tokens, ignore_eos=True).tokens
    for method in methods.values():
        method(prompts[0][:8])  # warm-up
    runs = run_interleaved(methods, prompts, device)
    reference, tokens = runs.outputs["target_only"], [new_tokens] * len(prompts)
    rows = {}
    for name, outputs in runs.outputs.items():
        rows[name] = {
            "tokens_per_s": new_tokens * len(prompts) / sum(runs.seconds[name]),
            "speedup": paired_speedup(tokens, runs.seconds[name], tokens, runs.seconds["target_only"], seed=seed),
            "same_output_as_target": sum(o == r for o, r in zip(outputs, reference)),
            "mean_shared_prefix": float(np.mean([first_divergence(o, r) for o, r in zip(outputs, reference)])),
        }
    return {"draft": draft.name, "gamma": gamma, "new_tokens": new_tokens, "n_prompts": len(prompts),
            "methods": rows, "int8_quality": quantization_quality(target_model, quantized, quality_prompts,
                                                                   quality_responses, seed=seed)}

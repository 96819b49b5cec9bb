"""`draftops sweep`: the boundary map. Where speculative decoding pays on this machine, and which draft and γ win.

Greedy acceptance comes from one teacher-forced pass per draft over target-greedy responses, walked
(`decode.acceptance.walk`) to the exact target calls the greedy decoder makes for every γ and generation length G;
the step costs are `decode.step_costs`'. A subset of cells is decoded for real, and the measured/predicted gap is
reported: it holds the per-round overhead and how much acceptance moves with context. Its axes beside γ and context:
batch size, draft size (`draft_size_axis`), token trees (`tree_axis`) and a quantized target (`quantization_axis`).
Figures and markdown: `decode.measure.sweep_report`; what it maps: docs/guide.md#when-does-it-pay-make-sweep.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np

from decode.generation_stats import aggregate_stats
from decode.measure.sweep_acceptance import acceptance_table, at_context, greedy_responses, spread
from decode.measure.sweep_axes import BATCH_CONTEXT, BATCHES, batch_axis, measure_quantization
from decode.measure.sweep_drafts import Draft
from decode.measure.sweep_prediction import predict_cells
from decode.runtime.forward import ModelRunner, greedy_decode
from decode.runtime.timing import run_interleaved
from decode.serving.llamacpp import LlamaServer
from decode.step_costs import measure_costs
from decode.tree_budget_prediction import (
    TREE_BUDGETS,
    context_schedule,
    predict_tree_budgets,
    recommend_tree_budget,
)
from pipeline.intervals import paired_speedup
from pipeline.traffic import encode_prompts

# --------------------------------------------------------------------------- choosing


def best_per_cell(cells: list[dict], drafts: Sequence[str]) -> list[dict]:
    """Per (context, generation length): the best (draft, γ) overall and each draft's best γ."""
    out = []
    keys = sorted({(c["context"], c["max_new_tokens"]) for c in cells})
    for context, n in keys:
        here = [c for c in cells if c["context"] == context and c["max_new_tokens"] == n]
        per_draft = {}
        for draft in drafts:
            best = max((c for c in here if c["draft"] == draft), key=lambda c: c["predicted_speedup"])
            per_draft[draft] = {key: best[key] for key in
                                ("gamma", "predicted_speedup", "alpha", "break_even_alpha", "c", "v")}
        winner = max(here, key=lambda c: c["predicted_speedup"])
        out.append({"context": context, "max_new_tokens": n, "draft": winner["draft"], "gamma": winner["gamma"],
                    "predicted_speedup": winner["predicted_speedup"],
                    "break_even_alpha": winner["break_even_alpha"], "alpha": winner["alpha"],
                    "per_draft": per_draft})
    return out


def mean_best_speedup(cells: list[dict], drafts: Sequence[str]) -> dict[str, float]:
    """Per draft: its predicted speedup at its best γ in each (context, generation length), averaged over them."""
    best: dict[tuple, float] = {}
    for c in cells:
        key = (c["draft"], c["context"], c["max_new_tokens"])
        best[key] = max(best.get(key, 0.0), c["predicted_speedup"])
    return {d: float(np.mean([x for (name, _, _), x in best.items() if name == d])) for d in drafts}


def recommend(cells: list[dict], drafts: Sequence[str], contexts: Sequence[int], long_tokens: int) -> dict:
    """The draft with the best mean predicted speedup over the cells (`mean_best_speedup`), and its γ by context
    length.

    γ(L) maximizes the steady-state speedup τ/(γc + v) at context L (acceptance over the longest generation); each
    schedule entry covers lengths up to the midpoint with the next measured context; equal neighbours merge.
    """
    mean = mean_best_speedup(cells, drafts)
    draft = max(mean, key=mean.get)

    def gamma_at(context: int) -> int:
        here = [c for c in cells
                if c["draft"] == draft and c["context"] == context and c["max_new_tokens"] == long_tokens]
        return max(here, key=lambda c: c["steady_speedup"])["gamma"]

    return {"draft": draft, "mean_predicted_speedup": mean, "gamma_schedule": context_schedule(contexts, gamma_at)}


# --------------------------------------------------------------------------- measured cells


def draft_size_axis(drafts: Sequence[Draft], cells: list[dict], measured: list[dict], acceptance: dict,
                    contexts: Sequence[int], lengths: Sequence[int]) -> dict | None:
    """The draft-size axis: each draft LM (a family from `draftops distill --sizes`, or any others) by its number of
    decoder layers, with its per-token acceptance α (T=0, over the longest generation), and at the smallest context
    and the middle generation length its best γ, cost c, verify cost v, predicted speedup and break-even α; its mean
    predicted speedup over every cell (`mean_best_speedup`, the recommendation's criterion) and its measured cell at
    the smallest context (the γ predicted best among those decoded for real). The recommended size is the draft with
    the best mean predicted speedup. None without a draft LM."""
    models = [d for d in drafts if d.grows_trees]
    if not models:
        return None
    context, new_tokens = min(contexts), lengths[len(lengths) // 2]
    mean = mean_best_speedup(cells, [d.name for d in models])
    rows = []
    for d in models:
        best = max((c for c in cells if c["draft"] == d.name and c["context"] == context
                    and c["max_new_tokens"] == new_tokens), key=lambda c: c["predicted_speedup"])
        decoded = max((m for m in measured if m["draft"] == d.name and m["context"] == context),
                      key=lambda m: m["predicted_speedup"], default=None)
        rows.append({"draft": d.name, "layers": d.model.config.num_hidden_layers,
                     "parameters": sum(p.numel() for p in d.model.parameters()),
                     "alpha": acceptance[d.name]["analytic_alpha"][str(max(lengths))],
                     **{key: best[key] for key in ("gamma", "c", "v", "predicted_speedup", "break_even_alpha")},
                     "mean_predicted_speedup": mean[d.name],
                     "measured": None if decoded is None else {
                         key: decoded[key] for key in ("gamma", "context", "max_new_tokens", "speedup",
                                                       "predicted_speedup", "gap", "same_output_as_target",
                                                       "n_prompts")}})
    rows.sort(key=lambda r: (r["layers"], r["draft"]))
    best = max(rows, key=lambda r: r["mean_predicted_speedup"])
    return {"context": context, "max_new_tokens": new_tokens, "rows": rows,
            "recommended": {"draft": best["draft"], "layers": best["layers"]}}


def measured_plan(cells: list[dict], drafts, gammas, contexts, lengths, recommended: str
                  ) -> list[tuple[str, int, int, int]]:
    """Cells decoded for real, at the shortest generation length: every γ of the recommended draft at the smallest
    context (speedup vs γ), each other draft's best γ there (every draft size decoded), and each draft's best γ at
    the largest context."""
    small, large, short = min(contexts), max(contexts), min(lengths)
    plan = [(recommended, g, small, short) for g in gammas]
    for context in (small, large):
        for d in drafts:
            here = [c for c in cells if c["draft"] == d and c["context"] == context and c["max_new_tokens"] == short]
            best = max(here, key=lambda c: c["predicted_speedup"])["gamma"]
            if (d, best, context, short) not in plan:
                plan.append((d, best, context, short))
    return plan


def measure_cells(target_model, drafts: Sequence[Draft], plan, prompts: Sequence[list[int]], filler: list[int],
                  *, seed: int = 0) -> list[dict]:
    """Decode each planned cell's prompts (at its context length) with the target alone and speculatively.

    Per (context, length), the target-only run and every planned speculative configuration take turns prompt by
    prompt, in an order that rotates, so machine load hits them alike. EOS stops no generation here, so every cell
    generates exactly its length.
    """
    device = next(target_model.parameters()).device
    by_name = {d.name: d for d in drafts}
    decoders = {}
    for name, gamma, _, _ in plan:
        d = by_name[name]
        decoders[(name, gamma)] = d.decoder(target_model, gamma)
    runner = ModelRunner(target_model)
    warm = prompts[0][:8]
    greedy_decode(runner, warm, 4)
    for decoder in decoders.values():
        decoder.generate(warm, max_new_tokens=4)

    results = []
    for context, n in sorted({(c, n) for _, _, c, n in plan}):
        configs = [(name, gamma) for name, gamma, c, m in plan if (c, m) == (context, n)]
        methods = {"target_only": lambda p: greedy_decode(runner, p, n),
                   **{config: partial(decoders[config].generate, max_new_tokens=n) for config in configs}}
        runs = run_interleaved(methods, [at_context(p, filler, context) for p in prompts], device)
        target_outputs, target_seconds = runs.outputs["target_only"], runs.seconds["target_only"]
        tokens = [n] * len(prompts)
        for name, gamma in configs:
            generated = runs.outputs[(name, gamma)]
            summary = aggregate_stats([g.stats for g in generated], seed=seed)
            results.append({
                "draft": name, "gamma": gamma, "context": context, "max_new_tokens": n, "n_prompts": len(prompts),
                "speedup": paired_speedup(tokens, runs.seconds[(name, gamma)], tokens, target_seconds, seed=seed),
                "target_only_s": float(sum(target_seconds)),
                "speculative_s": float(sum(runs.seconds[(name, gamma)])),
                "live_alpha": summary["acceptance_rate"], "live_tau": summary["tau"],
                "same_output_as_target": sum(g.token_ids == t for g, t in zip(generated, target_outputs)),
            })
    return results


# --------------------------------------------------------------------------- the whole sweep


def run_sweep(target, drafts: Sequence[Draft], requests: Sequence, *, gammas: Sequence[int], contexts: Sequence[int],
              lengths: Sequence[int], max_prompt_tokens: int, analytic_prompts: int = 8, measure_prompts: int = 3,
              reps: int = 10, tree_budgets: Sequence[int] = TREE_BUDGETS, batches: Sequence[int] = BATCHES,
              batch_context: int = BATCH_CONTEXT, quantization: bool = True, llama_cpp: LlamaServer | None = None,
              seed: int = 0, log: Callable[[str], None] = print) -> dict:
    """target: a `pipeline.sources.ResolvedModel`; requests: traffic requests. Greedy decoding throughout.
    tree_budgets: node budgets of the tree recommendation (empty: none); trees are at most max(gammas) levels deep.
    batches: batch sizes of the batch axis (empty: none), every sequence `batch_context` tokens long; its
    acceptance is the walk's over the longest generation length. quantization: put the int8 target beside the
    recommended draft (`measure_quantization`, with llama.cpp's target alone where `llama_cpp` is a started
    server; CPU only, a note elsewhere)."""
    gammas, contexts, lengths = sorted(set(gammas)), sorted(set(contexts)), sorted(set(lengths))
    tree_budgets, batches = sorted(set(tree_budgets)), sorted(set(batches))
    model, names = target.model, [d.name for d in drafts]
    check_settings(model, drafts, gammas, contexts, lengths, tree_budgets, batches, batch_context)
    prompts, _ = encode_prompts(spread(requests, analytic_prompts + measure_prompts), target.tokenizer,
                                max_prompt_tokens)
    analytic, measured = prompts[:analytic_prompts], prompts[analytic_prompts:] or prompts[:measure_prompts]
    filler = [t for p in prompts[::-1] for t in p]
    phase = Phases(log)
    phase("responses", f"target-only greedy responses: {len(analytic)} prompts x {max(lengths)} tokens")
    responses = greedy_responses(target, analytic, max(lengths))
    phase("acceptance", f"acceptance walks: {', '.join(names)}")
    tree_drafts = [d.name for d in drafts if d.grows_trees] if tree_budgets else []
    acceptance = {d.name: acceptance_table(model, d, analytic, responses, gammas, lengths, seed=seed,
                                           max_rank=max(tree_budgets) if d.name in tree_drafts else 0) for d in drafts}
    phase("costs", f"step costs at contexts {contexts}")
    cost_tokens = at_context([], filler, max(contexts) + max(gammas) + 1)
    costs = measure_costs(model, {d.name: d.drafter(model) for d in drafts}, cost_tokens, contexts, gammas, reps=reps,
                          tree_budgets=tree_budgets if tree_drafts else ())
    cells = predict_cells(costs, acceptance, gammas, contexts, lengths)
    trees = tree_axis(costs, acceptance, tree_drafts, tree_budgets, max(gammas))
    batch = None
    if batches:
        batch = batch_axis(model, drafts, costs, acceptance, [at_context(p, filler, batch_context) for p in analytic],
                           filler, batches=batches, gammas=gammas, lengths=lengths, reps=reps, phase=phase)
    recommendation = recommend(cells, names, contexts, max(lengths))
    plan = measured_plan(cells, names, gammas, contexts, lengths, recommendation["draft"])
    phase("measured", f"decoding {len(plan)} cells for real on {len(measured)} prompts")
    measured_cells = measure_cells(model, drafts, plan, measured, filler, seed=seed)
    quantized, notes = None, []
    if quantization:
        quantized, notes = quantization_axis(model, drafts, recommendation, measured, lengths[len(lengths) // 2],
                                             analytic, responses, llama_cpp=llama_cpp, seed=seed, phase=phase)
    phase("done", "sweep measured")
    del phase.seconds["done"]
    return {
        "settings": {"gammas": gammas, "contexts": contexts, "max_new_tokens": lengths, "tree_budgets": tree_budgets,
                     "batches": batches, "batch_context": batch_context,
                     "greedy": True, "analytic_prompts": len(analytic), "measure_prompts": len(measured), "reps": reps,
                     "device": str(next(model.parameters()).device)},
        "phase_seconds": phase.seconds,
        "drafts": {d.name: {"kind": "model" if d.is_model else "lookup",
                            "reduced_vocab": None if d.token_ids is None else len(d.token_ids)} for d in drafts},
        "costs": costs, "acceptance": acceptance, "cells": cells, "best": best_per_cell(cells, names),
        "measured": measured_cells, "gap": measured_gaps(cells, measured_cells), "tree_budgets": trees,
        "draft_sizes": draft_size_axis(drafts, cells, measured_cells, acceptance, contexts, lengths),
        "batch": batch, "quantization": quantized, "notes": notes,
        "recommendation": {**recommendation,
                           **(recommend_tree_budget(trees["rows"], contexts) if trees["rows"] else {})},
    }


def quantization_axis(model, drafts: Sequence[Draft], recommendation: dict, prompts: Sequence[list[int]],
                      new_tokens: int, analytic: Sequence[list[int]], responses, *, llama_cpp: LlamaServer | None,
                      seed: int, phase: Phases) -> tuple[dict | None, list[str]]:
    """The int8 target beside the recommended draft at its first γ (`measure_quantization`) -> (its table, notes):
    CPU targets only, a note elsewhere."""
    if next(model.parameters()).device.type != "cpu":
        return None, ["quantization: int8 dynamic quantization runs on CPU targets only"]
    draft = recommendation["draft"]
    phase("quantization", f"int8 target beside {draft}: {len(prompts)} prompts x {new_tokens} tokens")
    quantized = measure_quantization(model, next(d for d in drafts if d.name == draft),
                                     recommendation["gamma_schedule"][0][1], prompts, new_tokens, analytic, responses,
                                     llama_cpp=llama_cpp, seed=seed)
    return quantized, []


def check_settings(model, drafts: Sequence[Draft], gammas, contexts, lengths, tree_budgets, batches,
                   batch_context: int) -> None:
    """One-line errors for a grid the sweep cannot measure on this target."""
    if min(gammas) < 1 or min(contexts) < 2 or min(lengths) < 2 or min(tree_budgets, default=1) < 1:
        raise ValueError("need gammas >= 1, contexts >= 2, max-new-tokens >= 2 and tree budgets >= 1")
    if min(batches, default=1) < 1 or (batches and batch_context < 3):
        raise ValueError("need batch sizes >= 1 and a batch context >= 3 (a batched round feeds the draft 2 tokens)")
    window = getattr(model.config, "max_position_embeddings", None)
    if window is not None and max(contexts) + max(lengths) > window:
        raise ValueError(f"context {max(contexts)} + {max(lengths)} new tokens exceed the target's {window} positions")
    if window is not None and batches and batch_context + max(gammas) + 1 > window:
        raise ValueError(f"batch context {batch_context} exceeds the target's {window} positions")
    names = [d.name for d in drafts]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate drafts: {names}")


class Phases:
    """The sweep's phases: each call closes the running phase and opens the next, logging the time so far;
    `seconds` holds each phase's duration, for sizing runs."""

    def __init__(self, log: Callable[[str], None]):
        self.log, self.seconds, self.started = log, {}, time.perf_counter()

    def __call__(self, name: str, message: str) -> None:
        elapsed = time.perf_counter() - self.started
        if self.seconds:
            self.seconds[list(self.seconds)[-1]] = elapsed - sum(self.seconds.values())
        self.seconds[name] = 0.0
        self.log(f"{message} ({elapsed:.0f} s)")


def tree_axis(costs: dict, acceptance: dict, tree_drafts: Sequence[str], budgets: Sequence[int],
              max_depth: int) -> dict:
    """Predicted tokens/s per tree node budget for each draft LM, beside its best chain."""
    trees = {"budgets": budgets, "max_depth": max_depth, "rows": [], "chains": []}
    for name in tree_drafts:
        rows, chains = predict_tree_budgets(costs, name, acceptance[name]["rank_acceptance"], budgets, max_depth)
        trees["rows"] += rows
        trees["chains"] += chains
    return trees


def measured_gaps(cells: list[dict], measured_cells: list[dict]) -> dict:
    """Each measured cell's predicted speedup and its gap to the measured one (written into the cell), summarized."""
    by_key = {(c["draft"], c["gamma"], c["context"], c["max_new_tokens"]): c for c in cells}
    for m in measured_cells:
        predicted = by_key[(m["draft"], m["gamma"], m["context"], m["max_new_tokens"])]["predicted_speedup"]
        m["predicted_speedup"] = predicted
        m["gap"] = m["speedup"]["value"] / predicted - 1
    gaps = [abs(m["gap"]) for m in measured_cells]
    return {"mean_abs": float(np.mean(gaps)), "max_abs": float(np.max(gaps)),
            "mean": float(np.mean([m["gap"] for m in measured_cells]))}

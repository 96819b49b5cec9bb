"""`draftops sweep`: the boundary map. Where speculative decoding pays on this machine, and which draft and γ win.

Greedy acceptance on the traffic comes from one teacher-forced pass per draft over target-greedy responses (prompt
lookup: its lookups replayed over the same responses); `decode.acceptance.walk` over those per-token outcomes gives
exactly the target calls the greedy decoder makes, for every γ and generation length G (tested against the decoder).
Step costs and each cell's predicted time: `decode.step_costs`. A subset of cells is decoded for real
(target-only greedy vs the speculative decoder, interleaved, same prompts), and the measured/predicted gap is
reported: it holds the per-round overhead and how much acceptance moves with context. EOS does not stop any
generation here, so every cell generates exactly G tokens. Figures and markdown: `decode.measure.sweep_report`.

The batch axis (`decode.step_costs.measure_batch_costs`): the target's step and verify and each draft model's step
for B sequences at once, and the predicted speedup by batch size from the same walks: where speculation stops paying
as a server batches more requests.

The draft-size axis (`draft_size_axis`): the draft LMs swept (e.g. the family `draftops distill --sizes` registers
as `layers-N`) by number of layers: acceptance against cost beside the break-even curve, and the recommended size.

Token trees: the same pass ranks the target's token among each draft model's choices, and the tree verify is timed
at node budgets up to 64; `decode.tree_budget` predicts tokens/s per budget and context, and the sweep recommends a
node budget by context length (`decode.tree_budget_schedule`) next to the γ schedule.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch

from decode.acceptance import Block, analytic_acceptance, greedy_block, walk
from decode.drafters.chain import DRAFT, LOOKUP, Drafter, make_drafter
from decode.drafters.lookup import PROMPT_LOOKUP, PromptLookupDrafter
from decode.measure.batched import batched_greedy, batched_speculative
from decode.measure.intervals import aggregate_stats, paired_speedup, ratio_ci
from decode.measure.quantized import int8_dynamic, quantization_quality
from decode.measure.sweep_model import predict_batches, predict_cells
from decode.models.feature_draft import FeatureDraft
from decode.models.layer_draft import draft_from_target_layers, frequent_token_ids, reduce_vocabulary
from decode.runtime.forward import ModelRunner, greedy_decode
from decode.runtime.kernels import cpu_linear_of, use_cpu_linear
from decode.runtime.timing import run_interleaved
from decode.serving.llamacpp import LlamaServer, optional_rows, served_target
from decode.serving.loading import load_draft
from decode.speculative import SpeculativeDecoder
from decode.step_costs import measure_batch_costs, measure_costs
from decode.tree_budget import (
    TREE_BUDGETS,
    context_schedule,
    predict_tree_budgets,
    rank_acceptance,
    recommend_tree_budget,
)
from pipeline import draftops_home
from pipeline.files import write_text_atomic
from pipeline.sources import SourceError
from pipeline.traffic import encode_prompts

TARGET_LAYERS = "target-layers:"  # `target-layers:N[:V]`: the target's first N layers, embeddings, norm and head
BATCHES = (1, 2, 4, 8, 16, 32)  # batch sizes of the batch axis
BATCH_CONTEXT = 512  # the context length of every sequence of the batch axis
MEASURED_BATCH_MAX = 4  # batch sizes up to this one are also decoded for real (`measure_batches`)


@dataclass
class Draft:
    """A swept draft: a model (with optional reduced vocabulary), or prompt lookup when `model` is None. The sweep
    measures each alone at fixed γ, without lookup or a confidence stop."""

    name: str
    model: torch.nn.Module | None
    token_ids: torch.Tensor | None = None

    @property
    def is_model(self) -> bool:
        return self.model is not None

    @property
    def grows_trees(self) -> bool:
        """A draft LM: what `decode.drafters.tree.ModelTree` grows trees with (not prompt lookup, not a feature
        draft)."""
        return self.is_model and not isinstance(self.model, FeatureDraft)

    def drafter(self, target_model) -> Drafter:
        return make_drafter(DRAFT if self.is_model else LOOKUP, target_model, self.model,
                            draft_token_ids=self.token_ids)


def load_drafts(sources: Sequence[str], target, notes: list[str], vocab_texts: Sequence[list[int]] = ()) -> list[Draft]:
    """Draft sources: `prompt-lookup`, `target-layers:N[:V]`, or any model source; a trailing `?` makes one optional.
    A model source that is the same checkpoint as an earlier one (two aliases of one registered version: by
    fingerprint) is swept once, under the earlier name, with a note.

    `target-layers:N:V` keeps V rows of the head: the V most frequent ids in vocab_texts (token id lists, e.g. the
    traffic's prompts) plus the special tokens. target is a `pipeline.sources.ResolvedModel`; drafts land on its
    device and dtype.
    """

    parameter, kernels = next(target.model.parameters()), cpu_linear_of(target.model)
    drafts, fingerprints = [], {}
    for source in sources:
        name = source.rstrip("?")
        if name == PROMPT_LOOKUP:
            drafts.append(Draft(name, None))
        elif name.startswith(TARGET_LAYERS):
            n_layers, _, vocab = name[len(TARGET_LAYERS):].partition(":")
            model = draft_from_target_layers(target.model, list(range(int(n_layers)))).to(parameter.device)
            token_ids = None
            if vocab:
                if not vocab_texts:
                    raise ValueError(f"{name}: a reduced head needs token texts to count")
                token_ids = frequent_token_ids(vocab_texts, int(vocab), target.tokenizer.all_special_ids)
                reduce_vocabulary(model, token_ids, target.model.get_output_embeddings().weight.detach())
            drafts.append(Draft(name, use_cpu_linear(model.eval(), kernels), token_ids))
        else:
            try:
                resolved = load_draft(name, target, cpu_linear=kernels)
            except SourceError as exc:
                if not source.endswith("?"):
                    raise
                notes.append(f"optional draft {name} skipped: {exc}")
                continue
            if resolved.fingerprint in fingerprints:
                notes.append(f"{name} is the same draft as {fingerprints[resolved.fingerprint]}: swept once")
                continue
            fingerprints[resolved.fingerprint] = name
            drafts.append(Draft(name, resolved.model, resolved.token_ids))
    if not drafts:
        raise ValueError("no drafts to sweep")
    return drafts


# --------------------------------------------------------------------------- prompts


def spread(requests: Sequence, n: int) -> list:
    """n requests taken round-robin over categories (in order of first appearance), so every category is present."""
    by_category: dict[str, list] = {}
    for request in requests:
        by_category.setdefault(request.category, []).append(request)
    queues = list(by_category.values())
    picked = []
    while len(picked) < min(n, len(requests)):
        for queue in queues:
            if queue and len(picked) < n:
                picked.append(queue.pop(0))
    return picked


def at_context(prompt: list[int], filler: list[int], length: int) -> list[int]:
    """The prompt at exactly `length` tokens: earlier conversations (filler) before it, or its last tokens."""
    if len(prompt) >= length:
        return prompt[-length:]
    need = length - len(prompt)
    pool = filler * (need // max(len(filler), 1) + 1)
    return pool[len(pool) - need :] + prompt


def greedy_responses(target, prompts: Sequence[list[int]], new_tokens: int) -> list[list[int]]:
    """The target's greedy responses of `new_tokens` tokens (EOS ignored) to `prompts`, through the decoder's own
    forward; cached under $DRAFTOPS_HOME/cache/sweep/ by the target's fingerprint, the prompts and the length, so a
    second sweep of the same target and traffic does not decode them again."""
    key = hashlib.sha256(json.dumps([target.fingerprint, list(map(list, prompts)), new_tokens]).encode()).hexdigest()
    path = draftops_home() / "cache" / "sweep" / f"responses-{key[:20]}.json"
    if path.is_file():
        return json.loads(path.read_text())
    runner = ModelRunner(target.model)
    responses = [greedy_decode(runner, p, new_tokens) for p in prompts]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(responses))
    return responses


# --------------------------------------------------------------------------- acceptance


def lookup_block(drafter: PromptLookupDrafter, prompt: list[int], response: list[int]) -> Block:
    """Rounds of prompt lookup over prompt + response (for `walk`): its proposals compared with the target's tokens."""

    def block(t: int, k: int) -> tuple[int, int]:
        proposal = drafter.lookup(prompt + response[:t], k)
        run = 0
        while run < len(proposal) and proposal[run] == response[t + run]:
            run += 1
        return len(proposal), run

    return block


def acceptance_table(target_model, draft: Draft, prompts, responses, gammas, lengths, *, max_rank: int = 0,
                     seed: int = 0) -> dict:
    """α and τ per γ and generation length from the walk; for draft models also the per-token analytic α, and with
    max_rank the rank acceptances p_1..p_max_rank of the draft's tree (`decode.tree_budget.rank_acceptance`)."""
    if draft.is_model:
        analytic = analytic_acceptance(
            target_model, draft.model, [p + r for p, r in zip(prompts, responses)], [len(p) for p in prompts],
            temperature=0.0, draft_token_ids=draft.token_ids, batch_size=1, greedy_ranks=max_rank > 0)
        blocks = [greedy_block(m) for m in analytic.per_position]
    else:
        analytic = None
        blocks = [lookup_block(draft.drafter(target_model), p, r) for p, r in zip(prompts, responses)]
    table: dict = {"per_gamma": {}}
    if analytic is not None and max_rank:
        table["rank_acceptance"] = rank_acceptance(analytic.ranks, max_rank)
    if analytic is not None:
        table["analytic_alpha"] = {
            str(n): ratio_ci([sum(m[:n]) for m in analytic.per_position], [len(m[:n]) for m in analytic.per_position],
                             seed=seed).to_dict() for n in lengths}
    for gamma in gammas:
        table["per_gamma"][str(gamma)] = {}
        for n in lengths:
            walks = [walk(block, n, gamma) for block in blocks]
            table["per_gamma"][str(gamma)][str(n)] = {
                "alpha": ratio_ci([w.accepted for w in walks], [w.verified for w in walks], seed=seed).to_dict(),
                "tau": ratio_ci([n] * len(walks), [w.calls for w in walks], seed=seed).to_dict(),
                "calls_per_prompt": float(np.mean([w.calls for w in walks])),
                "rounds_per_prompt": {str(d): sum(w.rounds[d] for w in walks) / len(walks)
                                      for d in sorted({d for w in walks for d in w.rounds})},
            }
    return table


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
    prompt, in an order that rotates, so machine load hits them alike.
    """
    device = next(target_model.parameters()).device
    by_name = {d.name: d for d in drafts}
    decoders = {}
    for name, gamma, _, _ in plan:
        d = by_name[name]
        decoders[(name, gamma)] = SpeculativeDecoder(target_model, d.drafter(target_model), gamma, eos_token_ids=())
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
    decoder = SpeculativeDecoder(target_model, draft.drafter(target_model), gamma, eos_token_ids=())
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
    if min(gammas) < 1 or min(contexts) < 2 or min(lengths) < 2 or min(tree_budgets, default=1) < 1:
        raise ValueError("need gammas >= 1, contexts >= 2, max-new-tokens >= 2 and tree budgets >= 1")
    if min(batches, default=1) < 1 or (batches and batch_context < 3):
        raise ValueError("need batch sizes >= 1 and a batch context >= 3 (a batched round feeds the draft 2 tokens)")
    window = getattr(target.model.config, "max_position_embeddings", None)
    if window is not None and max(contexts) + max(lengths) > window:
        raise ValueError(f"context {max(contexts)} + {max(lengths)} new tokens exceed the target's {window} positions")
    if window is not None and batches and batch_context + max(gammas) + 1 > window:
        raise ValueError(f"batch context {batch_context} exceeds the target's {window} positions")
    names = [d.name for d in drafts]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate drafts: {names}")
    picked = spread(requests, analytic_prompts + measure_prompts)
    prompts, _ = encode_prompts(picked, target.tokenizer, max_prompt_tokens)
    analytic, measured = prompts[:analytic_prompts], prompts[analytic_prompts:] or prompts[:measure_prompts]
    filler = [t for p in prompts[::-1] for t in p]
    model = target.model
    phases: dict[str, float] = {}  # seconds per phase, for sizing runs
    started = time.perf_counter()

    def phase(name: str, message: str) -> None:
        """Close the running phase, open `name`."""
        elapsed = time.perf_counter() - started
        if phases:
            phases[list(phases)[-1]] = elapsed - sum(phases.values())
        phases[name] = 0.0
        log(f"{message} ({elapsed:.0f} s)")

    phase("responses", f"target-only greedy responses: {len(analytic)} prompts x {max(lengths)} tokens")
    responses = greedy_responses(target, analytic, max(lengths))
    acceptance = {}
    phase("acceptance", f"acceptance walks: {', '.join(names)}")
    tree_drafts = [d.name for d in drafts if d.grows_trees] if tree_budgets else []
    for d in drafts:
        acceptance[d.name] = acceptance_table(model, d, analytic, responses, gammas, lengths, seed=seed,
                                              max_rank=max(tree_budgets) if d.name in tree_drafts else 0)
    phase("costs", f"step costs at contexts {contexts}")
    cost_tokens = at_context([], filler, max(contexts) + max(gammas) + 1)
    proposers = {d.name: d.drafter(model) for d in drafts}
    costs = measure_costs(model, proposers, cost_tokens, contexts, gammas, reps=reps,
                          tree_budgets=tree_budgets if tree_drafts else ())
    cells = predict_cells(costs, acceptance, gammas, contexts, lengths)
    trees = {"budgets": tree_budgets, "max_depth": max(gammas), "rows": [], "chains": []}
    for name in tree_drafts:
        rows, chains = predict_tree_budgets(costs, name, acceptance[name]["rank_acceptance"], tree_budgets,
                                            max(gammas))
        trees["rows"] += rows
        trees["chains"] += chains
    batch = None
    if batches:
        batch = batch_axis(model, drafts, costs, acceptance, [at_context(p, filler, batch_context) for p in analytic],
                           filler, batches=batches, gammas=gammas, lengths=lengths, reps=reps, phase=phase)
    recommendation = recommend(cells, names, contexts, max(lengths))
    plan = measured_plan(cells, names, gammas, contexts, lengths, recommendation["draft"])
    phase("measured", f"decoding {len(plan)} cells for real on {len(measured)} prompts")
    measured_cells = measure_cells(model, drafts, plan, measured, filler, seed=seed)
    quantized, notes = None, []
    if quantization and next(model.parameters()).device.type == "cpu":
        middle = lengths[len(lengths) // 2]
        phase("quantization", f"int8 target beside {recommendation['draft']}: {len(measured)} prompts x {middle} "
                              "tokens")
        gamma = recommendation["gamma_schedule"][0][1]
        quantized = measure_quantization(model, next(d for d in drafts if d.name == recommendation["draft"]), gamma,
                                         measured, middle, analytic, responses, llama_cpp=llama_cpp, seed=seed)
    elif quantization:
        notes.append("quantization: int8 dynamic quantization runs on CPU targets only")
    phase("done", "sweep measured")
    del phases["done"]
    by_key = {(c["draft"], c["gamma"], c["context"], c["max_new_tokens"]): c for c in cells}
    for m in measured_cells:
        predicted = by_key[(m["draft"], m["gamma"], m["context"], m["max_new_tokens"])]["predicted_speedup"]
        m["predicted_speedup"] = predicted
        m["gap"] = m["speedup"]["value"] / predicted - 1
    gaps = [abs(m["gap"]) for m in measured_cells]
    sizes = draft_size_axis(drafts, cells, measured_cells, acceptance, contexts, lengths)
    return {
        "settings": {"gammas": gammas, "contexts": contexts, "max_new_tokens": lengths, "tree_budgets": tree_budgets,
                     "batches": batches, "batch_context": batch_context,
                     "greedy": True, "analytic_prompts": len(analytic), "measure_prompts": len(measured), "reps": reps,
                     "device": str(next(model.parameters()).device)},
        "phase_seconds": phases,
        "drafts": {d.name: {"kind": "model" if d.is_model else "lookup",
                            "reduced_vocab": None if d.token_ids is None else len(d.token_ids)} for d in drafts},
        "costs": costs,
        "acceptance": acceptance,
        "cells": cells,
        "best": best_per_cell(cells, names),
        "measured": measured_cells,
        "gap": {"mean_abs": float(np.mean(gaps)), "max_abs": float(np.max(gaps)),
                "mean": float(np.mean([m["gap"] for m in measured_cells]))},
        "tree_budgets": trees,
        "draft_sizes": sizes,
        "batch": batch,
        "quantization": quantized,
        "notes": notes,
        "recommendation": {**recommendation,
                           **(recommend_tree_budget(trees["rows"], contexts) if trees["rows"] else {})},
    }

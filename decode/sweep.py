"""`draftops sweep`: the boundary map. Where speculative decoding pays on this machine, and which draft and γ win.

Measured with the KV cache filled to each context length L, through the decoder's own functions: the target's prefill,
greedy step t(L) and verify round of n = 2..γmax+1 tokens (v(n) = verify / t); per draft its prefill and one round of
γ proposals for every γ (c(γ) = round / (γ t); prompt lookup's round is one lookup). Greedy acceptance on the traffic
comes from one teacher-forced pass per draft over target-greedy responses (prompt lookup: its lookups replayed over
the same responses); replaying the block process over those per-token outcomes ("the walk") gives exactly the target
calls the greedy decoder makes, for every γ and generation length G (tested against the decoder).

Predicted time of a request (prompt of L tokens, G new tokens), with costs at the mean context L + G/2:
    target alone:  P_t(L) + (G − 1) t
    speculative:   P_t(L) + P_d(L) + Σ over rounds (draft round + verify of d+1 tokens), d = tokens drafted that round
A subset of cells is decoded for real (target-only greedy vs the speculative decoder, interleaved, same prompts), and
the measured/predicted gap is reported: it holds the per-round overhead and how much acceptance moves with context.
EOS does not stop any generation here, so every cell generates exactly G tokens.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from decode.acceptance import analytic_acceptance, break_even_alpha
from decode.bench import paired_speedup, timed
from decode.ngram import PROMPT_LOOKUP, PromptLookupDrafter
from decode.runtime import ModelRunner, greedy_decode, load_model, rollback
from decode.speculative import SpeculativeDecoder, Warp, check_drafts
from decode.stats import aggregate_stats, ratio_ci

TARGET_LAYERS = "target-layers:"  # `target-layers:N[:V]`: the target's first N layers, embeddings, norm and head


@dataclass
class Draft:
    """A draft as the decoder takes it: a model (with optional reduced vocabulary) or a model-free drafter."""

    name: str
    drafter: object
    token_ids: torch.Tensor | None = None

    @property
    def is_model(self) -> bool:
        return isinstance(self.drafter, torch.nn.Module)

    def proposer(self, target_model):
        """What the decoder drafts with: the model wrapped in a `ModelDrafter`, or the model-free drafter itself."""
        return SpeculativeDecoder(target_model, self.drafter, 1, draft_token_ids=self.token_ids).drafter


def load_drafts(sources: Sequence[str], target, notes: list[str], vocab_texts: Sequence[list[int]] = ()) -> list[Draft]:
    """Draft sources: `prompt-lookup`, `target-layers:N[:V]`, or any model source; a trailing `?` makes one optional.

    `target-layers:N:V` keeps V rows of the head: the V most frequent ids in vocab_texts (token id lists, e.g. the
    traffic's prompts) plus the special tokens. target is a `pipeline.sources.ResolvedModel`; drafts land on its
    device and dtype.
    """
    from decode.drafts import draft_from_target_layers, frequent_token_ids, reduce_vocabulary
    from decode.kernels import cpu_linear_of, use_cpu_linear
    from pipeline.sources import SourceError, check_tokenizer_compat

    parameter, kernels = next(target.model.parameters()), cpu_linear_of(target.model)
    drafts = []
    for source in sources:
        name = source.rstrip("?")
        if name == PROMPT_LOOKUP:
            drafts.append(Draft(name, PromptLookupDrafter.for_model(target.model)))
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
                resolved = load_model(name, device=parameter.device, dtype=parameter.dtype, cpu_linear=kernels)
            except SourceError as exc:
                if not source.endswith("?"):
                    raise
                notes.append(f"optional draft {name} skipped: {exc}")
                continue
            check_tokenizer_compat(target.tokenizer, resolved.tokenizer)
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


# --------------------------------------------------------------------------- acceptance: the walk


@dataclass
class Walk:
    """The greedy block process over one response: rounds (target calls) and draft outcomes."""

    calls: int = 0
    drafted: int = 0
    verified: int = 0
    accepted: int = 0
    rounds: Counter = field(default_factory=Counter)  # rounds by the number of tokens drafted in them


def walk(block: Callable[[int, int], tuple[int, int]], n_tokens: int, gamma: int) -> Walk:
    """Replay greedy speculative decoding of n_tokens tokens as `SpeculativeDecoder` does.

    block(t, k) -> (drafted, accepted) of a round that starts with t response tokens known and drafts up to k.
    """
    w, t = Walk(), 0
    while t < n_tokens:
        drafted, accepted = block(t, min(gamma, n_tokens - t - 1))
        w.calls += 1
        w.rounds[drafted] += 1
        w.drafted += drafted
        w.verified += min(accepted + 1, drafted)
        w.accepted += accepted
        t += accepted + 1
    return w


def model_block(matches: Sequence[float]) -> Callable[[int, int], tuple[int, int]]:
    """Rounds of a draft model: matches[t] is 1 when its teacher-forced argmax equals the target's at token t."""

    def block(t: int, k: int) -> tuple[int, int]:
        run = 0
        while run < k and matches[t + run] >= 0.5:
            run += 1
        return k, run

    return block


def lookup_block(drafter: PromptLookupDrafter, prompt: list[int], response: list[int]):
    """Rounds of prompt lookup over prompt + response: its proposals compared with the target's tokens."""

    def block(t: int, k: int) -> tuple[int, int]:
        proposal = drafter.lookup(prompt + response[:t], k)
        run = 0
        while run < len(proposal) and proposal[run] == response[t + run]:
            run += 1
        return len(proposal), run

    return block


def acceptance_table(target_model, draft: Draft, prompts, responses, gammas, lengths, *, seed: int = 0) -> dict:
    """α and τ per γ and generation length from the walk; for draft models also the per-token analytic α."""
    if draft.is_model:
        analytic = analytic_acceptance(
            target_model, draft.drafter, [p + r for p, r in zip(prompts, responses)], [len(p) for p in prompts],
            temperature=0.0, draft_token_ids=draft.token_ids, batch_size=1)
        blocks = [model_block(m) for m in analytic.per_position]
    else:
        analytic = None
        blocks = [lookup_block(draft.drafter, p, r) for p, r in zip(prompts, responses)]
    table: dict = {"per_gamma": {}}
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


# --------------------------------------------------------------------------- costs


@torch.inference_mode()
def measure_costs(target_model, drafts: Sequence[Draft], tokens: list[int], contexts: Sequence[int],
                  gammas: Sequence[int], reps: int = 10, prefill_reps: int = 3) -> dict:
    """Median seconds at each context length L, through the decoder's own functions (greedy warp).

    Target: prefill of L tokens, one greedy step, and a verify round of n = 2..γmax+1 tokens (forward with every
    logit, the decoder's acceptance test `check_drafts`, the one sync). Per draft: its prefill (`start`) and one round of γ proposals
    (`propose`: forwards, warps and sampling of a draft model, or one lookup) for every γ. Every repetition times
    every quantity once, so a burst of load on the shared machine hits them alike; c and v are medians of the
    per-repetition ratios to that repetition's target step.
    """
    device = next(target_model.parameters()).device
    vocab_size = target_model.get_output_embeddings().weight.shape[0]
    warp, max_gamma = Warp(), max(gammas)
    proposers = {d.name: d.proposer(target_model) for d in drafts}
    runner = ModelRunner(target_model)  # the decoder's own target forward

    def prefill(start: Callable[[], object]) -> tuple[object, float]:
        runs = [timed(start, device) for _ in range(prefill_reps)]
        return runs[-1][0], statistics.median(seconds for _, seconds in runs)

    def target_prefill(length: int):
        cache = runner.new_cache()
        runner.forward(torch.tensor(tokens[:length], device=device), cache, 0, True)
        return cache

    def step(cache, length: int) -> Callable[[], int]:
        fed = torch.tensor(tokens[length : length + 1], device=device)
        return lambda: runner.forward(fed, cache, length, True)[-1].argmax().item()

    def verify_round(cache, length: int, n: int) -> Callable[[], list]:
        fed = torch.tensor(tokens[length : length + n], device=device)
        q = torch.nn.functional.one_hot(fed[1:], vocab_size).float()

        def run() -> list:
            accepted, next_tokens = check_drafts(runner.forward(fed, cache, length, False), q, fed[1:], warp, None)
            return torch.cat([accepted.long(), fed[1:], next_tokens]).tolist()

        return run

    # (quantity key, context index) -> (run, undo)
    timers: dict[tuple[str, int], tuple[Callable, Callable]] = {}
    prefill_s: dict[str, list[float]] = {"target": [], **{name: [] for name in proposers}}
    for i, length in enumerate(contexts):
        cache, seconds = prefill(lambda: target_prefill(length))
        prefill_s["target"].append(seconds)
        undo = (lambda c, n: lambda: rollback(c, n))(cache, length)
        timers[("step", i)] = (step(cache, length), undo)
        for n in range(2, max_gamma + 2):
            timers[(f"verify{n}", i)] = (verify_round(cache, length, n), undo)
        seq = tokens[: length + 1]
        for name, drafter in proposers.items():
            state, seconds = prefill(lambda: drafter.start(seq))
            prefill_s[name].append(seconds)
            for gamma in gammas:
                run = (lambda d, st, sq, g: lambda: d.propose(st, sq, g, warp, None))(drafter, state, seq, gamma)
                undo_draft = (lambda d, st, n: lambda: d.rollback(st, n))(drafter, state, length)
                timers[(f"{name}|{gamma}", i)] = (run, undo_draft)
    samples: dict[tuple[str, int], list[float]] = {key: [] for key in timers}
    for rep in range(reps + 2):
        for key, (run, undo) in timers.items():
            seconds = timed(run, device)[1]
            undo()
            if rep >= 2:  # warm-up
                samples[key].append(seconds)

    def seconds_of(key: str) -> list[float]:
        return [statistics.median(samples[(key, i)]) for i in range(len(contexts))]

    def ratio_to_step(key: str, divisor: int = 1) -> list[float]:
        return [statistics.median(s / (divisor * t) for s, t in zip(samples[(key, i)], samples[("step", i)]))
                for i in range(len(contexts))]

    verify_keys = [str(n) for n in range(2, max_gamma + 2)]
    target = {"prefill_s": prefill_s["target"], "step_s": seconds_of("step"),
              "verify_s": {n: seconds_of(f"verify{n}") for n in verify_keys},
              "v": {n: ratio_to_step(f"verify{n}") for n in verify_keys}}
    per_draft = {name: {"prefill_s": prefill_s[name],
                        "round_s": {str(g): seconds_of(f"{name}|{g}") for g in gammas},
                        "c": {str(g): ratio_to_step(f"{name}|{g}", g) for g in gammas}} for name in proposers}
    return {"contexts": list(contexts), "target": target, "drafts": per_draft}


# --------------------------------------------------------------------------- the cost model


def _at(costs: dict, values: Sequence[float], length: float) -> float:
    """A measured quantity at a context length: linear between measured contexts, flat beyond them."""
    return float(np.interp(length, costs["contexts"], values))


def cell_costs(costs: dict, draft: str, gamma: int, context: int, new_tokens: int) -> dict:
    """c, v and the target step at the mean context of the generation, the prefills at the prompt; a draft round of
    γ tokens and a (γ+1)-token verify in seconds as c·γ and v times the target step."""
    mean = context + new_tokens / 2
    t = costs["target"]
    d = costs["drafts"][draft]
    step = _at(costs, t["step_s"], mean)
    c = _at(costs, d["c"][str(gamma)], mean)
    v = _at(costs, t["v"][str(gamma + 1)], mean)
    verify_by_tokens = {1: step, **{n: _at(costs, t["v"][str(n)], mean) * step for n in range(2, gamma + 2)}}
    return {"target_step_s": step, "draft_round_s": gamma * c * step, "verify_s": v * step,
            "verify_s_by_tokens": verify_by_tokens,
            "target_prefill_s": _at(costs, t["prefill_s"], context),
            "draft_prefill_s": _at(costs, d["prefill_s"], context), "c": c, "v": v}


def predicted_seconds(k: dict, new_tokens: int, rounds: dict[int, float]) -> tuple[float, float]:
    """(target alone, speculative) seconds of one request under the cost model.

    rounds: rounds per request by the number of tokens drafted in them. A round that drafts d tokens verifies d+1:
    a prompt-lookup round that finds no match is a plain one-token step, one with a short match a short verify.
    (The first `make sweep` charged every round a full (γ+1)-token verify and under-predicted lookup by 24-41%.)
    """
    target_only = k["target_prefill_s"] + (new_tokens - 1) * k["target_step_s"]
    speculative = k["target_prefill_s"] + k["draft_prefill_s"] + sum(
        count * (k["draft_round_s"] + k["verify_s_by_tokens"][int(d) + 1]) for d, count in rounds.items())
    return target_only, speculative


def cell_break_even_alpha(k: dict, gamma: int, new_tokens: int) -> float:
    """The i.i.d. acceptance α below which this cell is slower than the target alone.

    With calls = G/τ(α), speedup 1 means τ(α) = (γc + v)·s, s = G·t / ((G − 1)·t − P_d): Leviathan's break-even with
    c and v scaled by s (the draft's prefill must be paid back by the generated tokens).
    """
    paid_back = (new_tokens - 1) * k["target_step_s"] - k["draft_prefill_s"]
    if paid_back <= 0:
        return 1.0
    scale = new_tokens * k["target_step_s"] / paid_back
    return break_even_alpha(gamma, k["c"] * scale, k["v"] * scale)


def predict_cells(costs: dict, acceptance: dict, gammas, contexts, lengths) -> list[dict]:
    cells = []
    for draft, table in acceptance.items():
        for gamma in gammas:
            for context in contexts:
                for n in lengths:
                    k = cell_costs(costs, draft, gamma, context, n)
                    row = table["per_gamma"][str(gamma)][str(n)]
                    target_s, spec_s = predicted_seconds(k, n, row["rounds_per_prompt"])
                    cells.append({
                        "draft": draft, "gamma": gamma, "context": context, "max_new_tokens": n,
                        "predicted_speedup": target_s / spec_s,
                        "steady_speedup": row["tau"]["value"] / (gamma * k["c"] + k["v"]),
                        "alpha": row["alpha"]["value"], "tau": row["tau"]["value"],
                        "break_even_alpha": cell_break_even_alpha(k, gamma, n),
                        "c": k["c"], "v": k["v"],
                    })
    return cells


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


def recommend(cells: list[dict], drafts: Sequence[str], contexts: Sequence[int], long_tokens: int) -> dict:
    """The draft with the best mean predicted speedup over all cells, and its γ by context length.

    γ(L) maximizes the steady-state speedup τ/(γc + v) at context L (acceptance over the longest generation); each
    schedule entry covers lengths up to the midpoint with the next measured context; equal neighbours merge.
    """
    mean = {d: float(np.mean([c["predicted_speedup"] for c in cells if c["draft"] == d])) for d in drafts}
    draft = max(mean, key=mean.get)
    schedule: list[list[int]] = []
    contexts = sorted(contexts)
    for i, context in enumerate(contexts):
        here = [c for c in cells if c["draft"] == draft and c["context"] == context and c["max_new_tokens"] == long_tokens]
        gamma = max(here, key=lambda c: c["steady_speedup"])["gamma"]
        bound = (context + contexts[i + 1]) // 2 if i + 1 < len(contexts) else context
        if schedule and schedule[-1][1] == gamma:
            schedule[-1][0] = bound
        else:
            schedule.append([bound, gamma])
    return {"draft": draft, "mean_predicted_speedup": mean, "gamma_schedule": schedule}


# --------------------------------------------------------------------------- measured cells


def measured_plan(cells: list[dict], drafts, gammas, contexts, lengths) -> list[tuple[str, int, int, int]]:
    """Cells decoded for real: every γ of every draft at the smallest context and generation length (speedup vs γ),
    and each draft's best γ at the largest context and the middle generation length."""
    small, large, middle = min(contexts), max(contexts), sorted(lengths)[len(lengths) // 2]
    plan = [(d, g, small, min(lengths)) for d in drafts for g in gammas]
    for d in drafts:
        here = [c for c in cells if c["draft"] == d and c["context"] == large and c["max_new_tokens"] == middle]
        best = max(here, key=lambda c: c["predicted_speedup"])["gamma"]
        if (d, best, large, middle) not in plan:
            plan.append((d, best, large, middle))
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
        decoders[(name, gamma)] = SpeculativeDecoder(target_model, d.drafter, gamma, draft_token_ids=d.token_ids)
    runner = ModelRunner(target_model)
    warm = prompts[0][:8]
    greedy_decode(runner, warm, 4)
    for decoder in decoders.values():
        decoder.generate(warm, max_new_tokens=4)

    results = []
    for context, n in sorted({(c, n) for _, _, c, n in plan}):
        configs = [(name, gamma) for name, gamma, c, m in plan if (c, m) == (context, n)]
        methods = ["target_only"] + configs
        seconds = {m: [] for m in methods}
        outputs = {m: [] for m in methods}
        stats = {m: [] for m in configs}
        for i, prompt in enumerate(prompts):
            prompt = at_context(prompt, filler, context)
            for method in methods[i % len(methods):] + methods[: i % len(methods)]:
                if method == "target_only":
                    out, s = timed(lambda: greedy_decode(runner, prompt, n), device)
                else:
                    result, s = timed(lambda: decoders[method].generate(prompt, max_new_tokens=n), device)
                    out = result.token_ids
                    stats[method].append(result.stats)
                outputs[method].append(out)
                seconds[method].append(s)
        tokens = [n] * len(prompts)
        for name, gamma in configs:
            summary = aggregate_stats(stats[(name, gamma)], seed=seed)
            results.append({
                "draft": name, "gamma": gamma, "context": context, "max_new_tokens": n, "n_prompts": len(prompts),
                "speedup": paired_speedup(tokens, seconds[(name, gamma)], tokens, seconds["target_only"], seed=seed),
                "target_only_s": float(sum(seconds["target_only"])),
                "speculative_s": float(sum(seconds[(name, gamma)])),
                "live_alpha": summary["acceptance_rate"], "live_tau": summary["tau"],
                "same_output_as_target": sum(a == b for a, b in zip(outputs[(name, gamma)], outputs["target_only"])),
            })
    return results


# --------------------------------------------------------------------------- the whole sweep


def run_sweep(target, drafts: Sequence[Draft], requests: Sequence, *, gammas: Sequence[int], contexts: Sequence[int],
              lengths: Sequence[int], max_prompt_tokens: int, analytic_prompts: int = 8, measure_prompts: int = 3,
              reps: int = 10, seed: int = 0, log: Callable[[str], None] = print) -> dict:
    """target: a `pipeline.sources.ResolvedModel`; requests: traffic requests. Greedy decoding throughout."""
    from pipeline.traffic import encode_prompts

    gammas, contexts, lengths = sorted(set(gammas)), sorted(set(contexts)), sorted(set(lengths))
    if min(gammas) < 1 or min(contexts) < 2 or min(lengths) < 2:
        raise ValueError("need gammas >= 1, contexts >= 2 and max-new-tokens >= 2")
    window = getattr(target.model.config, "max_position_embeddings", None)
    if window is not None and max(contexts) + max(lengths) > window:
        raise ValueError(f"context {max(contexts)} + {max(lengths)} new tokens exceed the target's {window} positions")
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
    runner = ModelRunner(model)
    responses = [greedy_decode(runner, p, max(lengths)) for p in analytic]
    acceptance = {}
    phase("acceptance", f"acceptance walks: {', '.join(names)}")
    for d in drafts:
        acceptance[d.name] = acceptance_table(model, d, analytic, responses, gammas, lengths, seed=seed)
    phase("costs", f"step costs at contexts {contexts}")
    cost_tokens = at_context([], filler, max(contexts) + max(gammas) + 1)
    costs = measure_costs(model, drafts, cost_tokens, contexts, gammas, reps=reps)
    cells = predict_cells(costs, acceptance, gammas, contexts, lengths)
    plan = measured_plan(cells, names, gammas, contexts, lengths)
    phase("measured", f"decoding {len(plan)} cells for real on {len(measured)} prompts")
    measured_cells = measure_cells(model, drafts, plan, measured, filler, seed=seed)
    phase("done", "sweep measured")
    del phases["done"]
    by_key = {(c["draft"], c["gamma"], c["context"], c["max_new_tokens"]): c for c in cells}
    for m in measured_cells:
        predicted = by_key[(m["draft"], m["gamma"], m["context"], m["max_new_tokens"])]["predicted_speedup"]
        m["predicted_speedup"] = predicted
        m["gap"] = m["speedup"]["value"] / predicted - 1
    gaps = [abs(m["gap"]) for m in measured_cells]
    return {
        "settings": {"gammas": gammas, "contexts": contexts, "max_new_tokens": lengths, "greedy": True,
                     "analytic_prompts": len(analytic), "measure_prompts": len(measured), "reps": reps,
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
        "recommendation": recommend(cells, names, contexts, max(lengths)),
    }


# --------------------------------------------------------------------------- reporting


def figures(report: dict) -> dict:
    """Name -> matplotlib figure: speedup vs γ, heat maps, break-even α vs draft cost, measured vs predicted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    s, cells, drafts = report["settings"], report["cells"], list(report["drafts"])
    small, short = min(s["contexts"]), min(s["max_new_tokens"])
    colors = {d: f"C{i}" for i, d in enumerate(drafts)}
    out = {}

    fig, ax = plt.subplots(figsize=(6, 4))
    for d in drafts:
        here = [c for c in cells if c["draft"] == d and c["context"] == small and c["max_new_tokens"] == short]
        ax.plot([c["gamma"] for c in here], [c["predicted_speedup"] for c in here], "-", color=colors[d],
                label=f"{d} (predicted)")
        meas = [m for m in report["measured"]
                if m["draft"] == d and m["context"] == small and m["max_new_tokens"] == short]
        if meas:
            ax.errorbar([m["gamma"] for m in meas], [m["speedup"]["value"] for m in meas],
                        yerr=[[m["speedup"]["value"] - m["speedup"]["low"] for m in meas],
                              [m["speedup"]["high"] - m["speedup"]["value"] for m in meas]],
                        fmt="o", color=colors[d], capsize=3)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set(xlabel="γ (draft tokens per target call)", ylabel="speedup vs target alone", xticks=s["gammas"],
           title=f"context {small}, {short} new tokens (dots: measured, 95% CI)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out["speedup_vs_gamma.png"] = fig

    fig, axes = plt.subplots(1, len(drafts), figsize=(4.2 * len(drafts) + 1, 3.8), squeeze=False, layout="constrained")
    values = [c["predicted_speedup"] for c in cells]
    norm = TwoSlopeNorm(vcenter=1.0, vmin=min(min(values), 0.99), vmax=max(max(values), 1.01))
    for ax, d in zip(axes[0], drafts):
        grid = np.zeros((len(s["contexts"]), len(s["max_new_tokens"])))
        for i, context in enumerate(s["contexts"]):
            for j, n in enumerate(s["max_new_tokens"]):
                best = report["best"][i * len(s["max_new_tokens"]) + j]["per_draft"][d]
                grid[i, j] = best["predicted_speedup"]
                ax.text(j, i, f"{grid[i, j]:.2f}x\nγ={best['gamma']}", ha="center", va="center", fontsize=7)
        image = ax.imshow(grid, cmap="RdBu", norm=norm, origin="lower", aspect="auto")
        ax.set(xticks=range(len(s["max_new_tokens"])), xticklabels=s["max_new_tokens"],
               yticks=range(len(s["contexts"])), yticklabels=s["contexts"], xlabel="new tokens",
               ylabel="context (prompt tokens)", title=d)
    fig.colorbar(image, ax=axes[0].tolist(), label="predicted speedup (best γ)")
    out["speedup_heatmap.png"] = fig

    fig, ax = plt.subplots(figsize=(6, 4))
    costs = report["costs"]
    c_max = max(1.0, 1.2 * max(c["c"] for c in cells))
    grid_c = np.linspace(0, c_max, 60)
    for gamma in s["gammas"]:
        v = costs["target"]["v"][str(gamma + 1)][0]  # at the smallest context
        ax.plot(grid_c, [break_even_alpha(gamma, c, v) for c in grid_c], lw=1, label=f"γ={gamma}")
    for d in drafts:
        here = [c for c in cells if c["draft"] == d and c["context"] == small and c["max_new_tokens"] == max(
            s["max_new_tokens"])]
        best = max(here, key=lambda c: c["steady_speedup"])
        ax.plot(best["c"], best["alpha"], "*", ms=12, color=colors[d], label=f"{d}: α at γ={best['gamma']}")
    ax.set(xlabel="draft cost c (draft step / target step)", ylabel="α needed to break even", ylim=(0, 1.02),
           title=f"break-even acceptance (v measured at context {small})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out["break_even_alpha.png"] = fig

    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    for d in drafts:
        meas = [m for m in report["measured"] if m["draft"] == d]
        ax.errorbar([m["predicted_speedup"] for m in meas], [m["speedup"]["value"] for m in meas],
                    yerr=[[m["speedup"]["value"] - m["speedup"]["low"] for m in meas],
                          [m["speedup"]["high"] - m["speedup"]["value"] for m in meas]],
                    fmt="o", color=colors[d], capsize=3, label=d)
    everything = [m["predicted_speedup"] for m in report["measured"]] + [m["speedup"]["value"]
                                                                         for m in report["measured"]]
    low, high = 0.9 * min(everything), 1.1 * max(everything)
    ax.plot([low, high], [low, high], color="gray", lw=0.8, ls="--")
    ax.set(xlabel="predicted speedup", ylabel="measured speedup", xlim=(low, high), ylim=(low, high),
           title=f"mean |gap| {report['gap']['mean_abs']:.0%}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out["measured_vs_predicted.png"] = fig
    return out


def markdown(report: dict) -> str:
    s, costs = report["settings"], report["costs"]
    lines = [
        "# draftops sweep",
        "",
        f"Greedy, device {s['device']}; acceptance from {s['analytic_prompts']} traffic prompts, real decoding on "
        f"{s['measure_prompts']} prompts per measured cell. Speedup = target-only request time / speculative "
        "request time (prefill included, EOS ignored).",
        "",
        "## Costs (ms) by context length",
        "",
    ]
    top = str(max(int(n) for n in costs["target"]["v"]))
    g_low, g_high = str(min(s["gammas"])), str(max(s["gammas"]))
    lines += [
        f"| context | target prefill | target step | v(2) | v({top}) | "
        + " | ".join(f"{d}: prefill, c(γ={g_low}), c(γ={g_high})" for d in report["drafts"]) + " |",
        "|---:|---:|---:|---:|---:|" + "---|" * len(report["drafts"]),
    ]
    for i, context in enumerate(costs["contexts"]):
        t = costs["target"]
        lines.append(f"| {context} | {t['prefill_s'][i] * 1e3:.1f} | {t['step_s'][i] * 1e3:.2f} | "
                     f"{t['v']['2'][i]:.2f} | {t['v'][top][i]:.2f} | " + " | ".join(
                         f"{c['prefill_s'][i] * 1e3:.1f}, {c['c'][g_low][i]:.3f}, {c['c'][g_high][i]:.3f}"
                         for c in costs["drafts"].values()) + " |")
    lines += ["", "c(γ) = one round of γ proposals / (γ target steps); v(n) = verify round of n tokens / target step.",
              "", "## Acceptance on the traffic (walk over target-greedy responses)", "",
              "| draft | γ | " + " | ".join(f"α / τ, {n} tok" for n in s["max_new_tokens"]) + " |",
              "|---|---:|" + "---|" * len(s["max_new_tokens"])]
    for d, table in report["acceptance"].items():
        for gamma, rows in table["per_gamma"].items():
            lines.append(f"| {d} | {gamma} | " + " | ".join(
                f"{rows[str(n)]['alpha']['value']:.3f} / {rows[str(n)]['tau']['value']:.2f}"
                for n in s["max_new_tokens"]) + " |")
    lines += ["", "## Best (draft, γ) per context and generation length (predicted)", "",
              "| context | new tokens | best draft | γ | speedup | α | break-even α | "
              + " | ".join(f"{d}: γ, speedup, break-even α" for d in report["drafts"]) + " |",
              "|---:|---:|---|---:|---:|---:|---:|" + "---|" * len(report["drafts"])]
    for b in report["best"]:
        lines.append(f"| {b['context']} | {b['max_new_tokens']} | {b['draft']} | {b['gamma']} | "
                     f"{b['predicted_speedup']:.2f}x | {b['alpha']:.3f} | {b['break_even_alpha']:.3f} | "
                     + " | ".join(f"{p['gamma']}, {p['predicted_speedup']:.2f}x, {p['break_even_alpha']:.3f}"
                                  for p in b["per_draft"].values()) + " |")
    lines += ["", "## Measured vs predicted", "",
              "| draft | γ | context | new tokens | measured | predicted | gap | live α̂ | live τ | same output |",
              "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for m in report["measured"]:
        sp = m["speedup"]
        lines.append(f"| {m['draft']} | {m['gamma']} | {m['context']} | {m['max_new_tokens']} | "
                     f"{sp['value']:.2f}x [{sp['low']:.2f}, {sp['high']:.2f}] | {m['predicted_speedup']:.2f}x | "
                     f"{m['gap']:+.0%} | {m['live_alpha']['value']:.3f} | {m['live_tau']['value']:.2f} | "
                     f"{m['same_output_as_target']}/{m['n_prompts']} |")
    g, r = report["gap"], report["recommendation"]
    lines += ["", f"Gap measured/predicted − 1: mean {g['mean']:+.1%}, mean |gap| {g['mean_abs']:.1%}, "
              f"max |gap| {g['max_abs']:.1%}.", "",
              f"## Recommendation: --draft {r['draft']} with decode.gamma_schedule {r['gamma_schedule']}", ""]
    lines += [f"- note: {n}" for n in report.get("notes", [])]
    return "\n".join(lines) + "\n"


def write_decode_config(cfg, recommendation: dict, path: Path, target: str) -> Path:
    """The config with the swept target and the recommended γ schedule (decode.gamma: its first γ), for
    `draftops decode/eval/bench`."""
    from pipeline.config import save_config

    schedule = recommendation["gamma_schedule"]
    tuned = cfg.model_copy(deep=True)
    tuned.target = target
    tuned.decode.gamma = schedule[0][1]
    tuned.decode.gamma_schedule = [tuple(entry) for entry in schedule]
    save_config(tuned, path)
    path.write_text(f"# Written by `draftops sweep`: use with --draft {recommendation['draft']}\n" + path.read_text())
    return path

"""The sweep's cost model: the predicted time of a request from the step costs `decode.step_costs` measures.

Predicted time of a request (prompt of L tokens, G new tokens), with costs at the mean context L + G/2:
    target alone:  P_t(L) + (G - 1) t
    speculative:   P_t(L) + P_d(L) + sum over rounds (draft round + verify of d+1 tokens), d = tokens drafted that round
The rounds come from `decode.acceptance.walk` over the traffic (`decode.measure.sweep.acceptance_table`)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from decode.acceptance import break_even_alpha


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
    Charging every round a full (γ+1)-token verify under-predicts prompt lookup (docs/results.md).
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
    """Every (draft, γ, context, generation length): predicted and steady-state speedup, α, τ, break-even α, c, v.

    acceptance: draft name -> its `decode.measure.sweep.acceptance_table`.
    """
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


def predict_batches(batch_costs: dict, costs: dict, acceptance: dict, lookups: Sequence[str], gammas: Sequence[int],
                    new_tokens: int) -> dict:
    """Per draft and batch size B: the predicted speedup of each γ in steady state (prefills left out), the best γ,
    its c and v at B and the i.i.d. break-even α they give (`decode.acceptance.break_even_alpha`), and the smallest
    measured B at which the best γ no longer pays ("stops_paying_at"; None when every measured B pays).

    Each sequence of the batch takes its own rounds (`acceptance[draft]["per_gamma"][γ][new_tokens]
    ["rounds_per_prompt"]`, from the walk): a round that drafts d tokens costs the draft round plus a verify of d + 1
    tokens at B (a plain step when d = 0), against new_tokens steps of the target alone at B. A draft model's round
    of γ proposals is γ of its steps at B; a prompt-lookup draft's (`lookups`) is B of its lookups, one per sequence,
    each as long as one in `costs` (`measure_costs`) at the batch's context. Drafts measured neither way (a feature
    draft) are left out.
    """
    t = batch_costs["target"]
    lookup_round_s = {name: {g: _at(costs, seconds, batch_costs["context"])
                             for g, seconds in costs["drafts"][name]["round_s"].items()} for name in lookups}
    rows, stops = [], {}
    for draft, table in acceptance.items():
        if draft not in batch_costs["drafts"] and draft not in lookup_round_s:
            continue
        per_batch = []
        for i, b in enumerate(batch_costs["batches"]):
            step = t["step_s"][i]
            verify = {1: step, **{int(n): seconds[i] for n, seconds in t["verify_s"].items()}}
            speedups, draft_rounds = {}, {}
            for gamma in gammas:
                if draft in batch_costs["drafts"]:
                    draft_rounds[gamma] = gamma * batch_costs["drafts"][draft]["step_s"][i]
                else:
                    draft_rounds[gamma] = b * lookup_round_s[draft][str(gamma)]
                rounds = table["per_gamma"][str(gamma)][str(new_tokens)]["rounds_per_prompt"]
                spec = sum(count * (draft_rounds[gamma] + verify[int(d) + 1]) for d, count in rounds.items())
                speedups[gamma] = new_tokens * step / spec
            gamma = max(speedups, key=speedups.get)
            row = table["per_gamma"][str(gamma)][str(new_tokens)]
            c, v = draft_rounds[gamma] / (gamma * step), verify[gamma + 1] / step
            per_batch.append({"draft": draft, "batch": b, "gamma": gamma, "predicted_speedup": speedups[gamma],
                              "per_gamma": {str(g): x for g, x in speedups.items()}, "alpha": row["alpha"]["value"],
                              "tau": row["tau"]["value"], "c": c, "v": v,
                              "break_even_alpha": break_even_alpha(gamma, c, v)})
        rows += per_batch
        stops[draft] = next((r["batch"] for r in per_batch if r["predicted_speedup"] < 1), None)
    return {"rows": rows, "stops_paying_at": stops}

"""The sweep's acceptance: the target's greedy responses to spread-out traffic prompts, and per draft the
acceptance walk over them (`decode.acceptance.walk`) for every γ and generation length."""
from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import numpy as np

from decode.acceptance import Block, analytic_acceptance, greedy_block, walk
from decode.drafters.lookup import PromptLookupDrafter
from decode.measure.sweep_drafts import Draft
from decode.runtime.forward import ModelRunner, greedy_decode
from decode.tree_budget_prediction import (
    rank_acceptance,
)
from pipeline import draftops_home
from pipeline.files import write_text_atomic
from pipeline.intervals import ratio_ci


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
    max_rank the rank acceptances p_1..p_max_rank of the draft's tree
    (`decode.tree_budget_prediction.rank_acceptance`)."""
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

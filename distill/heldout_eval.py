"""How good a draft is as a speculator, on held-out target responses: acceptance α at T=0 and T=1 and the τ
(tokens per target call) it would give with blocks of γ (`decode.acceptance.simulated_tau`, the decoder's walk); at
the end of a job also the per-position acceptance of chains of k and their mean acceptance length as vLLM counts
them (`decode.chain_acceptance`; the held-out responses are the target's greedy text, so T=0 chains are exact).

`cached_eval` needs only the draft and the cached target top-k (cheap: run during training to pick the best
checkpoint); `exact_eval` runs the target alongside (once, on the best draft at the end of a job).
"""
from __future__ import annotations

import random

import torch

from decode.acceptance import analytic_acceptance, draft_rank, simulated_tau, token_mean
from decode.chain_acceptance import ENGINE_CHAIN, chain_summary, chains_from_matches, chains_from_steps
from decode.sampling import to_student_columns
from distill.data.batches import collate
from distill.data.features import heldout_features
from distill.data.responses import ResponseSet
from pipeline.intervals import ratio_ci
from pipeline.turns import request_of, turn_position


@torch.no_grad()
def cached_eval(response_logits, responses: ResponseSet, token_ids: torch.Tensor | None, gamma: int,
                batch_size: int = 8) -> dict:
    """α and simulated τ on held-out target responses, from the draft alone and the cached target top-k.

    response_logits: a `distill.step.ResponseLogits` over the draft, or what accelerate prepared from it. The loop
    passes the prepared module, so that under FSDP the forward gathers the sharded parameters as in training.
    Greedy (T=0) values are exact: the target's argmax is its cached top-1. At T=1, Σ over the cached top-k of
    min(p, q) is a lower bound on α (short by at most the teacher's mass beyond its top k).
    """
    device = next(response_logits.parameters()).device
    k = responses.topk_indices.shape[1]
    greedy, sampled = [], []
    for begin in range(0, len(responses), batch_size):
        rows = list(range(begin, min(begin + batch_size, len(responses))))
        batch = collate(responses, rows, pad_id=0, token_ids=None, with_teacher=True, topk=k)
        mask = batch["loss_mask"]
        logits = response_logits(input_ids=batch["input_ids"].to(device),
                                 attention_mask=batch["attention_mask"].to(device), loss_mask=mask.to(device))
        probs = torch.softmax(logits.float(), -1)  # [N, V_draft]: the response positions of every row, in order
        top_p = batch["teacher"].logprobs[mask].float().exp().to(device)
        top_ids = batch["teacher"].indices[mask].long().to(device)
        draft_argmax = probs.argmax(-1) if token_ids is None else token_ids.to(device)[probs.argmax(-1)]
        agree = (draft_argmax == top_ids[:, 0]).float()
        overlap = torch.minimum(top_p, _draft_probs_at(probs, top_ids, token_ids)).sum(-1)
        counts = mask.sum(1).tolist()
        greedy += [chunk.tolist() for chunk in agree.split(counts)]
        sampled += [chunk.tolist() for chunk in overlap.split(counts)]
    return summarize_acceptance(greedy, sampled, gamma)


def _draft_probs_at(probs: torch.Tensor, target_ids: torch.Tensor, token_ids: torch.Tensor | None) -> torch.Tensor:
    """q at the given target ids (0 for ids outside a reduced vocabulary)."""
    columns = to_student_columns(target_ids, token_ids, ignore_index=-1)
    return torch.where(columns >= 0, probs.gather(-1, columns.clamp(min=0)), torch.zeros((), dtype=probs.dtype,
                                                                                          device=probs.device))


def summarize_acceptance(greedy: list[list[float]], sampled: list[list[float]], gamma: int) -> dict:
    return {"alpha_t0": token_mean(greedy), "alpha_t1": token_mean(sampled), "tau_t0": simulated_tau(greedy, gamma),
            "tau_t1": simulated_tau(sampled, gamma)}


def exact_eval(target, draft, responses: ResponseSet, token_ids: torch.Tensor | None, gamma: int, *,
               with_ranks: bool = False, by_turn: bool = False, chain_k: int = ENGINE_CHAIN) -> dict:
    """α at T=0 and T=1 and simulated τ with the target run alongside (decode.acceptance.analytic_acceptance), and
    `chain`: chains of `chain_k` drafts at T=0 (`decode.chain_acceptance.chain_summary`).
    with_ranks: also `ranks`, per response where the target's greedy token stands in the draft's order at each of its
    positions (what `decode.tree_budget_prediction.rank_acceptance` turns into a token tree's p_r). by_turn: the
    responses
    are the turns of held-out conversations (`pipeline.turns` ids): the intervals resample requests, the unit of
    measurement, and α(T=0) is reported per turn position too (`alpha_t0_turn{p}`)."""
    seqs = [p + r for p, r in zip(responses.prompt_ids, responses.response_ids)]
    starts = [len(p) for p in responses.prompt_ids]
    greedy = analytic_acceptance(target, draft, seqs, starts, temperature=0.0, draft_token_ids=token_ids,
                                 greedy_ranks=with_ranks)
    sampled = analytic_acceptance(target, draft, seqs, starts, temperature=1.0, draft_token_ids=token_ids)
    units = [request_of(i) for i in responses.request_ids] if by_turn else None
    chains = chains_from_matches(greedy.per_position, chain_k)
    summary = {**summarize_acceptance(greedy.per_position, sampled.per_position, gamma),
               **alpha_interval(greedy.per_position, "alpha_t0", units),
               **alpha_interval(sampled.per_position, "alpha_t1", units),
               "chain": chain_summary(chains),
               "per_response": per_response_sums(greedy.per_position, sampled.per_position, chains)}
    if by_turn:
        positions = [turn_position(i) for i in responses.request_ids]
        for position in sorted(set(positions)):
            rows = [row for row, p in zip(greedy.per_position, positions) if p == position]
            summary[f"alpha_t0_turn{position}"] = token_mean(rows)
    return {**summary, "ranks": greedy.ranks} if with_ranks else summary


def per_response_sums(greedy: list[list[float]], sampled: list[list[float]], chains) -> dict:
    """Per held-out response, (sum, count) of α(T=0), of α(T=1) and of the tokens accepted in chains of k: what a
    paired comparison of two drafts resamples (`pipeline.intervals.paired_ratio_difference`)."""
    def sums(rows):
        return [(float(sum(row)), len(row)) for row in rows]
    return {"alpha_t0": sums(greedy), "alpha_t1": sums(sampled), "chain_accepted": sums(chains.accepted)}


def alpha_interval(per_response: list[list[float]], name: str, units: list[str] | None = None) -> dict:
    """`{name}_low`, `{name}_high`: the 95% interval of the token mean over the responses by a bootstrap over
    held-out prompts (one response each; with `units`, the responses of one unit resampled together), the noise
    against which two drafts' α are compared."""
    sums: dict[object, float] = {}
    counts: dict[object, int] = {}
    for i, row in enumerate(per_response):
        unit = i if units is None else units[i]
        sums[unit] = sums.get(unit, 0.0) + sum(row)
        counts[unit] = counts.get(unit, 0) + len(row)
    ci = ratio_ci(list(sums.values()), list(counts.values()))
    return {f"{name}_low": ci.low, f"{name}_high": ci.high}


@torch.no_grad()
def feature_eval(step_logits, target, responses: ResponseSet, token_ids: torch.Tensor | None, gamma: int,
                 batch_size: int = 4, rollouts: int = 16, seed: int = 0, with_ranks: bool = False,
                 chain_k: int | None = None) -> dict:
    """`cached_eval` for a feature draft, whose j-th token past a verified prefix comes from its own features:
    acceptance by draft position and τ from walking each held-out response in rounds of γ, each round's drafts
    taken from the draft's unrolled steps at the round's start (what decoding proposes there).

    step_logits: a `distill.step.FeatureStepLogits` (or what accelerate prepared from it) unrolling at least γ steps;
    target: the HF target, which gives the features (once per response set: `heldout_features`). α(T=0) is exact;
    at T=1 a draft position's acceptance is Σ over the cached top-k of min(p, q) along the response (a lower bound),
    and τ(T=1) is walked with those values.
    with_ranks: also `ranks` (`exact_eval`'s), in the order of the first draft position. chain_k: also `chain`,
    chains of that many drafts at T=0 (`exact_eval`'s), and the interval of α(T=0).
    """
    device = next(step_logits.parameters()).device
    module = getattr(step_logits, "module", step_logits)
    layers, k = module.draft.feature_layers, responses.topk_indices.shape[1]
    heldout_features(target, responses, layers)
    steps = max(gamma, chain_k or 0)
    chains = {0.0: [], 1.0: []}  # per response: [steps, positions] acceptance of draft position j at each round start
    ranks: list[list[int]] = []
    for begin in range(0, len(responses), batch_size):
        rows = list(range(begin, min(begin + batch_size, len(responses))))
        batch = collate(responses, rows, pad_id=0, token_ids=None, with_teacher=True, topk=k, with_features=True)
        features = batch["features"].to(device)
        mask = batch["loss_mask"].to(device)
        every = torch.ones_like(mask)
        per_step = step_logits(features=features, input_ids=batch["input_ids"].to(device),
                               attention_mask=batch["attention_mask"].to(device), loss_mask=every, steps=steps)
        top_p = batch["teacher"].logprobs.float().exp().to(device)  # [B, T, k]
        top_ids = batch["teacher"].indices.long().to(device)
        b, t = mask.shape
        greedy = torch.zeros(steps, b, t, device=device)
        sampled = torch.zeros(steps, b, t, device=device)
        for j, logits in enumerate(per_step):
            probs = torch.softmax(logits.float(), -1).view(b, t - 1 - j, -1)
            draft_ids = probs.argmax(-1) if token_ids is None else token_ids.to(device)[probs.argmax(-1)]
            # step j at index i proposes token i + 2 + j, tested against the target at position i + 1 + j
            valid = mask[:, 1 + j :]
            agree = (draft_ids == top_ids[:, 1 + j :, 0]) & valid
            overlap = torch.minimum(top_p[:, 1 + j :], _draft_probs_at(probs, top_ids[:, 1 + j :], token_ids))
            greedy[j, :, : t - 1 - j] = agree.float()
            sampled[j, :, : t - 1 - j] = overlap.sum(-1) * valid
            if j == 0 and with_ranks:
                first_ranks = draft_rank(probs, top_ids[:, 1:, 0], token_ids)
                ranks += [r[v].tolist() for r, v in zip(first_ranks, valid.bool())]
        for row, index in enumerate(rows):
            start, end = len(responses.prompt_ids[index]), int(batch["attention_mask"][row].sum())
            chains[0.0].append((greedy[:, row, : end].cpu(), start, end))
            chains[1.0].append((sampled[:, row, : end].cpu(), start, end))
    summary = summarize_feature_acceptance(chains, gamma, rollouts, seed)
    if chain_k:
        first = [chain[0, max(start - 2, 0) : end - 2].tolist() for chain, start, end in chains[0.0]]
        first_t1 = [chain[0, max(start - 2, 0) : end - 2].tolist() for chain, start, end in chains[1.0]]
        walked = chains_from_steps(chains[0.0], chain_k)
        summary.update(alpha_interval(first, "alpha_t0"), chain=chain_summary(walked),
                       per_response=per_response_sums(first, first_t1, walked))
    return {**summary, "ranks": ranks} if with_ranks else summary


def walk_rounds(chain: torch.Tensor, start: int, end: int, rng) -> tuple[int, list[tuple[int, bool]]]:
    """Target calls to produce tokens start..end-1, in rounds that each begin at sequence length L with the drafts
    of index L - 2 (chain[j, L - 2]: acceptance of its j-th draft), and the (position, accepted) of every tested
    draft. 0/1 values walk exactly; others accept with that probability."""
    length, calls, tested = start, 0, []
    gamma = chain.shape[0]
    while length < end:
        calls, n = calls + 1, 0
        while n < gamma and length + n < end:
            accepted = rng.random() < float(chain[n, length - 2]) if length >= 2 else False
            tested.append((n, accepted))
            if not accepted:
                break
            n += 1
        length += n + 1
    return calls, tested


def summarize_feature_acceptance(chains: dict, gamma: int, rollouts: int, seed: int) -> dict:
    """α(T=0), α(T=1) of the first draft position, τ at both temperatures from `walk_rounds`, and the acceptance at
    each draft position given the ones before it were accepted (`alpha_t0_pos{j}`, `alpha_t1_pos{j}`)."""
    rng, out = random.Random(seed), {}
    for temperature, name in ((0.0, "t0"), (1.0, "t1")):
        tokens = calls = 0
        tested, accepted = [0] * gamma, [0] * gamma
        first = [v for chain, start, end in chains[temperature] for v in chain[0, max(start - 2, 0) : end - 2].tolist()]
        for chain, start, end in chains[temperature]:
            repeats = 1 if temperature == 0.0 else rollouts
            for _ in range(repeats):
                n_calls, outcomes = walk_rounds(chain[:gamma], start, end, rng)
                tokens, calls = tokens + end - start, calls + n_calls
                for position, ok in outcomes:
                    tested[position] += 1
                    accepted[position] += ok
        out[f"alpha_{name}"] = sum(first) / len(first) if first else float("nan")
        out[f"tau_{name}"] = tokens / calls if calls else float("nan")
        for j in range(gamma):
            out[f"alpha_{name}_pos{j + 1}"] = accepted[j] / tested[j] if tested[j] else float("nan")
    return out

"""How good a draft is as a speculator, on held-out target responses: acceptance α at T=0 and T=1 and the τ
(tokens per target call) it would give with blocks of γ (`decode.acceptance.simulated_tau`, the decoder's walk).

`cached_eval` needs only the draft and the cached target top-k (cheap: run during training to pick the best
checkpoint); `exact_eval` runs the target alongside (once, on the best draft at the end of a job).
"""
from __future__ import annotations

import torch

from decode.acceptance import analytic_acceptance, simulated_tau
from distill.batches import collate
from distill.losses import to_student_columns
from distill.responses import ResponseSet


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
    def mean(rows):
        values = [a for r in rows for a in r]
        return sum(values) / len(values) if values else float("nan")

    return {"alpha_t0": mean(greedy), "alpha_t1": mean(sampled), "tau_t0": simulated_tau(greedy, gamma),
            "tau_t1": simulated_tau(sampled, gamma)}


def exact_eval(target, draft, responses: ResponseSet, token_ids: torch.Tensor | None, gamma: int) -> dict:
    """α at T=0 and T=1 and simulated τ with the target run alongside (decode.acceptance.analytic_acceptance)."""
    seqs = [p + r for p, r in zip(responses.prompt_ids, responses.response_ids)]
    starts = [len(p) for p in responses.prompt_ids]
    per_t = {t: analytic_acceptance(target, draft, seqs, starts, temperature=t, draft_token_ids=token_ids).per_position
             for t in (0.0, 1.0)}
    return summarize_acceptance(per_t[0.0], per_t[1.0], gamma)

"""Distillation losses between a teacher (target) distribution p and a student (draft) distribution q.

torchtune kd_losses style: fp32, computed only on the masked (response) positions, summed and divided by a token
count the caller passes in. Passing the *global* count (all processes, all accumulation micro-batches) makes the
summed gradients equal the gradient of the global per-token mean, whatever the process/micro-batch split.
Every divergence works on "buckets" (`bucket_log_probs`): log-probabilities over the same columns for p and q, shape
[N, C], whether the teacher is full logits or a cached top-k and whether the student's vocabulary is reduced.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipeline.config import LossName

TAIL_FLOOR = 1e-6


@dataclass
class TopKTeacher:
    """Cached teacher [..., k]: top-k log-probs (temperature 1) and their student columns (-1: outside its vocab)."""

    logprobs: torch.Tensor
    indices: torch.Tensor

    def __getitem__(self, mask: torch.Tensor) -> TopKTeacher:
        return TopKTeacher(self.logprobs[mask], self.indices[mask])


# --------------------------------------------------------------------------- divergences over buckets [N, C] -> [N]


def _plogp_ratio(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """Σ a (log a − log b) with 0·log 0 = 0 (a bucket with zero mass adds nothing, and no nan)."""
    terms = torch.exp(log_a) * (log_a - log_b)
    return torch.where(torch.isneginf(log_a), torch.zeros_like(terms), terms).sum(-1)


def forward_kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q): mass-covering; what TRL calls β = 0."""
    return _plogp_ratio(log_p, log_q)


def reverse_kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(q ‖ p): mode-seeking; what TRL calls β = 1."""
    return _plogp_ratio(log_q, log_p)


def generalized_jsd(log_p: torch.Tensor, log_q: torch.Tensor, beta: float) -> torch.Tensor:
    """β·KL(p ‖ m) + (1 − β)·KL(q ‖ m) with m = β·p + (1 − β)·q (TRL `generalized_jsd_loss`).

    As in TRL the endpoints are defined as the two KLs (the formula itself tends to 0 there): β = 0 is the forward
    KL and β = 1 the reverse KL, exactly.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"jsd beta must lie in [0, 1], got {beta}")
    if beta == 0.0:
        return forward_kl(log_p, log_q)
    if beta == 1.0:
        return reverse_kl(log_p, log_q)
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log(1.0 - beta))
    return beta * _plogp_ratio(log_p, log_m) + (1.0 - beta) * _plogp_ratio(log_q, log_m)


def total_variation(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """1 − Σ min(p, q): one minus the speculative-decoding acceptance probability α, so it targets α directly."""
    return 1.0 - torch.minimum(log_p.exp(), log_q.exp()).sum(-1)


def argmax_cross_entropy(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """−log q of the teacher's most likely bucket: what greedy acceptance rewards (the draft's first choice being the
    target's), with none of the teacher's mass elsewhere; the limit of forward KL as the teacher's temperature → 0."""
    return -log_q.gather(-1, log_p.argmax(-1, keepdim=True)).squeeze(-1)


DIVERGENCES = {"forward_kl": forward_kl, "reverse_kl": reverse_kl, "tvd": total_variation,
               "argmax_ce": argmax_cross_entropy}
ACCEPTANCE_LOSSES = ("log_acceptance", "kl_tv")
# log_acceptance: −log(α + ε); ε bounds the weight a position the draft cannot reach gets (1/ε instead of ∞)
LOG_ACCEPTANCE_EPS = 1e-3


# --------------------------------------------------------------------------- acceptance objectives
# Not computed on buckets: a bucket's min(p, q) would count the tail and the mass outside the draft vocabulary.


def acceptance_rate(student_logits: torch.Tensor, teacher: torch.Tensor | TopKTeacher, *,
                    temperature: float = 1.0, token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """α = Σ min(p, q) per position, [N]: the chance that speculative sampling accepts the draft's token.

    p is the target's distribution over its whole vocabulary: restricted to the draft's columns, not renormalized,
    so the target's mass on ids the draft cannot emit is never acceptable. A top-k teacher counts its listed ids
    inside the draft vocabulary only (a lower bound, exact when the target's mass beyond its top k is zero).
    """
    log_q = F.log_softmax(student_logits.float() / temperature, dim=-1)
    if isinstance(teacher, TopKTeacher):
        if temperature != 1.0:
            raise ValueError("a top-k teacher cache holds temperature-1 log-probs; use temperature 1 or online logits")
        listed = teacher.indices >= 0
        p = teacher.logprobs.float().exp() * listed
        q = log_q.gather(-1, teacher.indices.long().clamp(min=0)).exp() * listed
        return torch.minimum(p, q).sum(-1)
    log_p = F.log_softmax(teacher.float() / temperature, dim=-1)
    if token_ids is not None:
        log_p = log_p[..., token_ids.to(log_p.device)]
    if log_p.shape[-1] != log_q.shape[-1]:
        raise ValueError(f"teacher has {log_p.shape[-1]} columns, student {log_q.shape[-1]}: pass token_ids")
    return torch.minimum(log_p.exp(), log_q.exp()).sum(-1)


def kl_weight(alpha: torch.Tensor) -> torch.Tensor:
    """The adaptive weight λ of KL in `kl_tv`: 1 − the batch's mean acceptance, detached. A draft that accepts little
    learns from KL, whose gradient reaches every id the target likes; as it accepts more, the total-variation term
    (1 − α, acceptance itself) takes over, since a small draft cannot reach KL's optimum."""
    return (1.0 - alpha.detach().mean()).clamp(0.0, 1.0) if alpha.numel() else alpha.new_ones(())


def acceptance_loss(loss: str, alpha: torch.Tensor, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """Per-position loss [N] of an acceptance objective: `log_acceptance` −log(α + ε), whose gradient −∇α / α scales
    itself where acceptance is low; `kl_tv` λ·KL(p ‖ q) + (1 − λ)·(1 − α) with λ = `kl_weight(α)`."""
    if loss == "log_acceptance":
        return -torch.log(alpha + LOG_ACCEPTANCE_EPS)
    lam = kl_weight(alpha)
    return lam * forward_kl(log_p, log_q) + (1.0 - lam) * (1.0 - alpha)


def reach_weights(alphas: list[torch.Tensor], masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """The chance that each training-time-test step is reached, per scored position: step j at index i counts only if
    steps 0..j−1 at index i were accepted, Π α (detached). alphas[j]: step j's acceptance at its scored positions,
    masks[j] [B, T − 1 − j]: which indices step j scores. An earlier step that scored no token at index i (its
    token lies in the prompt) was not drafted and counts 1."""
    weights, reached = [], None
    for alpha, mask in zip(alphas, masks):
        width = mask.shape[1]
        reached = torch.ones_like(mask, dtype=alpha.dtype) if reached is None else reached[:, :width].clone()
        weights.append(reached[mask])
        step = torch.ones_like(reached)
        step[mask] = alpha.detach().to(step.dtype)
        reached = reached * step
    return weights


# --------------------------------------------------------------------------- teacher/student -> buckets


def bucket_log_probs(
    student_logits: torch.Tensor,
    teacher: torch.Tensor | TopKTeacher,
    *,
    temperature: float = 1.0,
    token_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p, log q) over common buckets, fp32, for already-selected positions (student logits [N, V_draft]).

    Full teacher logits: the buckets are the student's vocabulary. A reduced-vocabulary student (`token_ids`) has
    q = 0 outside it, so the teacher is the target conditioned on the draft vocabulary (restricted and renormalized):
    the minimizer of the forward KL under that support constraint and one of the TVD's (it reaches the largest
    acceptance Σ_S min(p, q) = p(S)).

    Top-k teacher: the k cached ids plus one tail bucket (1 − the listed mass, floored at `TAIL_FLOOR`: fp16 values can
    sum above 1 and k may cover the whole vocabulary, so no bucket is ever log 0). The loss is then the divergence
    between these coarse-grained distributions: by the data-processing inequality a lower bound on the full-vocabulary
    divergence, equal to it when the teacher's tail is zero. Ids the student cannot emit (-1) join the teacher's tail.
    """
    if isinstance(teacher, TopKTeacher):
        if temperature != 1.0:
            raise ValueError("a top-k teacher cache holds temperature-1 log-probs; use temperature 1 or online logits")
        log_q = F.log_softmax(student_logits.float(), dim=-1)
        # Entries outside the student's vocabulary (index -1) have zero mass on both sides, so the teacher's share of
        # them lands in its tail. Both tails are 1 - the top-k's mass (floored): the student's, so computed, is its
        # exact mass elsewhere without a pass over its whole vocabulary or a scattered copy of its log-probs.
        outside = teacher.indices < 0
        log_p_top = teacher.logprobs.float().masked_fill(outside, float("-inf"))
        log_q_top = log_q.gather(-1, teacher.indices.long().clamp(min=0)).masked_fill(outside, float("-inf"))
        log_p_tail, log_q_tail = (torch.log(torch.clamp(1.0 - top.exp().sum(-1, keepdim=True), min=TAIL_FLOOR))
                                  for top in (log_p_top, log_q_top))
        return torch.cat([log_p_top, log_p_tail], -1), torch.cat([log_q_top, log_q_tail], -1)
    log_q = F.log_softmax(student_logits.float() / temperature, dim=-1)
    teacher_logits = teacher if token_ids is None else teacher[..., token_ids.to(teacher.device)]
    if teacher_logits.shape[-1] != log_q.shape[-1]:
        raise ValueError(f"teacher has {teacher_logits.shape[-1]} columns, student {log_q.shape[-1]}: pass token_ids")
    return F.log_softmax(teacher_logits.float() / temperature, dim=-1), log_q


# --------------------------------------------------------------------------- the training loss


def token_losses(student_logits: torch.Tensor, teacher: torch.Tensor | TopKTeacher, *, loss: LossName,
                 beta: float = 0.5, temperature: float = 1.0, token_ids: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the divergence `loss` [N], the acceptance α [N] where the objective uses it, else None) at already-selected
    positions (student logits [N, V_draft]); not "ce". One log-softmax of the student serves both."""
    log_p, log_q = bucket_log_probs(student_logits, teacher, temperature=temperature, token_ids=token_ids)
    if loss in ACCEPTANCE_LOSSES:
        if isinstance(teacher, TopKTeacher):  # `acceptance_rate`'s value: the listed buckets, never the tail
            alpha = torch.minimum(log_p[..., :-1], log_q[..., :-1]).exp().sum(-1)
        else:  # a full teacher's buckets are renormalized over the draft vocabulary; α is not
            alpha = acceptance_rate(student_logits, teacher, temperature=temperature, token_ids=token_ids)
        return acceptance_loss(loss, alpha, log_p, log_q), alpha
    if loss == "jsd":
        return generalized_jsd(log_p, log_q, beta), None
    return DIVERGENCES[loss](log_p, log_q), None


def distillation_loss(
    student_logits: torch.Tensor,
    teacher: torch.Tensor | TopKTeacher | None,
    mask: torch.Tensor | None = None,
    *,
    loss: LossName = "forward_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    token_ids: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    ce_weight: float = 0.0,
    num_tokens: int | torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    per_token: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum of per-token divergences (+ ce_weight · cross-entropy on `labels`) over `mask`, divided by `num_tokens`.

    student_logits [B, T, V_draft]; teacher [B, T, V_target] logits or a TopKTeacher [B, T, k] (unused, may be None,
    with loss="ce"); mask [B, T] bool (True on positions whose *next* token is a response token, already aligned
    with the logits); labels [B, T] in student columns (`decode.sampling.to_student_columns`), -100 ignored. Without a
    mask the positions are already selected (a head evaluated only at response positions): student_logits [N, V_draft],
    teacher [N, ...], labels [N]. `num_tokens` defaults to the number of selected positions; with none selected the
    result is a zero that still carries a graph, so backward() and DDP gradient sync work as usual. weights [N]
    (selected positions) scale each position's divergence: a later draft step's chance of being reached. per_token:
    that divergence when the caller has it already (`token_losses` at the selected positions).
    """
    if mask is not None:
        mask = mask.bool()
        student_logits = student_logits[mask]
        teacher = None if teacher is None else teacher[mask]
        labels = None if labels is None else labels[mask]
    if (ce_weight or loss == "ce") and labels is None:
        raise ValueError("cross-entropy (loss='ce' or ce_weight > 0) needs labels")
    if loss == "ce":  # the plain-CE baseline: the teacher's sampled tokens, none of its distribution
        total = F.cross_entropy(student_logits.float(), labels, ignore_index=-100, reduction="sum")
    else:
        if per_token is None:
            per_token, _ = token_losses(student_logits, teacher, loss=loss, beta=beta, temperature=temperature,
                                        token_ids=token_ids)
        total = (per_token if weights is None else per_token * weights).sum()
    if ce_weight:
        total = total + ce_weight * F.cross_entropy(student_logits.float(), labels, ignore_index=-100, reduction="sum")
    if num_tokens is None:
        num_tokens = student_logits.shape[0]
    return total / torch.clamp(torch.as_tensor(num_tokens, dtype=total.dtype, device=total.device), min=1)

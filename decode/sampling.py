"""Logit warping and sampling shared by the target p and the draft q.

Speculative decoding is lossless for the *warped* target distribution, so both models go through the same
`warp_logits` (temperature, then top-k, then top-p) before any acceptance test.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def warp_logits(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """Turn logits [..., V] into fp32 probabilities [..., V].

    temperature 0 is greedy: a one-hot on the argmax. top_k=0 and top_p=1.0 disable those filters.
    """
    logits = logits.float()
    if temperature <= 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        # Keep the smallest prefix whose mass reaches top_p (the top token is always kept).
        drop_sorted = mass_before >= top_p
        drop = drop_sorted.scatter(-1, sorted_idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one index per row of probs [..., V] -> [...] (LongTensor), without a device sync.

    argmax(p / E) with E ~ Exp(1) is distributed as p (the exponential race, as in gpt-fast).
    """
    race = torch.empty_like(probs).exponential_(1, generator=generator)
    return torch.argmax(probs / race, dim=-1)


def to_target_vocab(probs: torch.Tensor, token_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Scatter reduced-vocab draft probabilities [..., |token_ids|] onto the full target vocab (0 elsewhere)."""
    if token_ids is None:
        return probs
    full = probs.new_zeros(*probs.shape[:-1], vocab_size)
    return full.scatter_(-1, token_ids.expand(*probs.shape[:-1], -1), probs)


def to_student_columns(
    target_ids: torch.Tensor, token_ids: torch.Tensor | None, ignore_index: int = -100
) -> torch.Tensor:
    """Map target token ids to draft head rows (ids outside the draft vocabulary become `ignore_index`)."""
    if token_ids is None:
        return target_ids
    token_ids = token_ids.to(target_ids.device)
    pos = torch.searchsorted(token_ids, target_ids).clamp(max=len(token_ids) - 1)
    return torch.where(token_ids[pos] == target_ids, pos, torch.full_like(pos, ignore_index))


@dataclass(frozen=True)
class Warp:
    """The sampling settings applied to both p and q (`warp_logits`); temperature 0 is greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return warp_logits(logits, self.temperature, self.top_k, self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def confident(draft_logits: torch.Tensor, min_confidence: float) -> bool:
    """Whether the draft's top probability (softmax at temperature 1) reaches `min_confidence`: a weak draft's
    confidence predicts its acceptance, so stopping a block where it is unsure saves draft steps and verify width."""
    return draft_logits.float().softmax(-1).max().item() >= min_confidence


def draft_token(logits: torch.Tensor, warp: Warp, token_ids: torch.Tensor | None, vocab_size: int,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A draft's next token (a target id) from its logits over its own rows (`token_ids`: the target ids of a reduced
    head's rows), and its q over the target vocabulary (None when greedy: the greedy test reads the token only)."""
    if warp.greedy:
        row = logits.argmax()
        return (row if token_ids is None else token_ids[row]), None
    q = to_target_vocab(warp(logits), token_ids, vocab_size)
    return sample(q, generator), q

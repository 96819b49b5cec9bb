"""The continuous-batching generator's per-step choice over the whole vocabulary, in few passes over the logits.

Each step of `decode.runtime.batch_generation` records the top-k log-probs of 64 rows' next-token distributions and
draws their tokens. Over a 49,152-id vocabulary the straightforward way (log_softmax, then topk; softmax / T, a copy in
fp64, its running sum, searchsorted) makes several full passes and [B, V] copies, a noticeable share of a generation
step on a small CPU (docs/results.md#the-cpu-runtime). Here:

- `topk_log_probs`: topk of the raw logits (log_softmax is monotone) minus their logsumexp: no [B, V] log-probs.
- `inverse_cdf_sample`: exp((x - max) / T) in place, its sums per block of 256 ids (their running sum in fp64), the
  block the draw lands in, then a running sum over that block alone: the same inverse CDF without a [B, V] fp64 copy
  or a sequential running sum over the vocabulary.

Both give the same log-probs and draws up to fp rounding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 256  # ids per block of the inverse CDF's two-level search


def topk_log_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest log-probs of softmax(logits) per row and their ids, largest first -> (values [B, k] fp32,
    ids [B, k] int64). logits: [B, V] fp32."""
    top, ids = logits.topk(k, dim=-1)
    largest = top[:, :1]
    log_total = (logits - largest).exp_().sum(-1, keepdim=True).log_()
    return top - largest - log_total, ids


def inverse_cdf_sample(logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One id per row drawn from softmax(logits / T) at the row's uniform number u in [0, 1): the first id whose
    running probability sum exceeds u -> [B] int64. logits: [B, V] fp32 (left untouched); temperatures, uniforms: [B].

    A draw depends only on the row's logits, T and u, never on the other rows, so a sampled job's tokens do not depend
    on the batch it ran in. An id of probability 0 is never drawn."""
    rows, vocab = logits.shape
    blocks = -(-vocab // BLOCK)
    weights = logits.new_empty(rows, blocks * BLOCK)
    weights[:, vocab:] = 0  # ids past the vocabulary weigh 0
    scale = 1 / temperatures.to(logits)[:, None]
    torch.mul(logits, scale, out=weights[:, :vocab]).sub_(logits.amax(-1, keepdim=True) * scale).exp_()
    weights = weights.view(rows, blocks, BLOCK)
    ends = weights.sum(-1).double().cumsum(-1)  # the running sum at each block's end
    draws = uniforms.to(ends.device, torch.float64)[:, None] * ends[:, -1:]
    block = torch.searchsorted(ends, draws, right=True).clamp_(max=blocks - 1)  # never a block of weight 0
    rest = draws - F.pad(ends, (1, 0)).gather(1, block)  # the draw past the running sum before its block
    within = weights[torch.arange(rows, device=logits.device), block[:, 0]].double().cumsum(-1)
    # the block's sum and its running sum round differently: a draw past the latter takes the block's last id of
    # weight > 0
    last = torch.searchsorted(within, within[:, -1:].contiguous())
    offset = torch.minimum(torch.searchsorted(within, rest, right=True), last)
    return (block * BLOCK + offset)[:, 0]

"""The on-policy stage: a draft trained on its own chains of k tokens, scored by the target.

From every response position i of a training row (the last verified token), the draft proposes a chain d(i, 1..k) as
the decoder does: greedily on even rows, sampled on odd ones. The chains are laid out after the row, one level per
chain depth, under a tree mask: a level-j node of start i sits at position i + j and sees the row up to i and its own
chain before it. One target pass over the layout scores every node against the target's distribution given the
draft's own tokens, and one draft pass trains on them; node (j, i) counts with the chance that the chain reaches it,
the product of its chain's earlier acceptances (detached). The training-time test of EAGLE, for a draft that reads
tokens; a feature draft's chains are its unroll fed its own proposals (`propose_features`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from decode.models.architectures import head_logits
from decode.models.feature_draft import FeatureDraft, window_start
from decode.runtime.masks import FULL, layer_windows
from distill.losses import acceptance_rate, distillation_loss
from pipeline.config import DistillConfig


@dataclass
class ChainLayout:
    """A batch of rows [B, T] with chains of k laid out after them: tokens, positions and the additive tree mask
    [B, 1, L, L] of the layout (L = T + (k − 1)·S); `nodes` [B, k, S] the layout column whose output predicts the
    (j + 1)-th token of start s's chain, `valid` [B, k, S] whether that token lies in the response."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    mask: torch.Tensor
    nodes: torch.Tensor
    valid: torch.Tensor
    starts: torch.Tensor

    def to(self, device) -> ChainLayout:
        return ChainLayout(*(getattr(self, f).to(device) for f in
                             ("input_ids", "position_ids", "mask", "nodes", "valid", "starts")))


def chain_starts(loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every response position of each row as a chain start, [B, S] with S the most any row has; a shorter row's
    extra entries repeat its first start and are marked False in the second tensor."""
    counts = loss_mask.sum(1)
    width = max(int(counts.max()), 1)
    order = torch.argsort((~loss_mask).to(torch.int8), dim=1, stable=True)[:, :width]  # response indices first
    real = torch.arange(width)[None, :] < counts[:, None]
    return torch.where(real, order, order[:, :1]), real


def layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor, k: int,
           dtype: torch.dtype) -> ChainLayout:
    """The layout of `input_ids` (right-padded) with room for chains of k from every response position; the chain
    tokens are placeholders until `propose` fills them."""
    b, t = input_ids.shape
    starts, real = chain_starts(loss_mask)
    s = starts.shape[1]
    length = t + (k - 1) * s
    ids = torch.cat([input_ids, input_ids.new_zeros(b, (k - 1) * s)], 1)
    levels = torch.arange(1, k)[:, None]  # [k - 1, 1]
    positions = torch.cat([torch.arange(t).expand(b, t), (starts[:, None, :] + levels).reshape(b, -1)], 1)
    visible = torch.zeros(b, length, length, dtype=torch.bool)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    visible[:, :t, :t] = causal & attention_mask.bool()[:, None, :] | torch.eye(t, dtype=torch.bool)
    row = torch.arange(b)[:, None]
    for j in range(1, k):  # level j of start s: the row up to the start, and its chain's levels 1..j
        columns = t + (j - 1) * s + torch.arange(s)
        visible[row, columns[None, :].expand(b, s), :t] = torch.arange(t)[None, None, :] <= starts[:, :, None]
        for earlier in range(1, j + 1):
            visible[row, columns, t + (earlier - 1) * s + torch.arange(s)] = True
    mask = torch.zeros(b, 1, length, length, dtype=dtype).masked_fill_(~visible[:, None], torch.finfo(dtype).min)
    base = starts[:, None, :]
    nodes = torch.cat([base, t + (torch.arange(1, k)[None, :, None] - 1) * s + torch.arange(s)[None, None, :]
                       .expand(b, k - 1, s)], 1)
    padded = torch.cat([loss_mask, loss_mask.new_zeros(b, k)], 1)
    valid = torch.stack([padded.gather(1, starts + j) for j in range(k)], 1) & real[:, None, :]
    return ChainLayout(ids, positions, mask, nodes, valid, starts)


def node_hidden(model, chains: ChainLayout, upto: int | None = None) -> torch.Tensor:
    """The last hidden states of `model` (an HF causal LM) at the layout's nodes, [B, k, S, H]; `upto`: feed only
    the layout's first `upto` columns (the nodes of the levels they hold)."""
    length = chains.input_ids.shape[1] if upto is None else upto
    out = model.model(input_ids=chains.input_ids[:, :length], position_ids=chains.position_ids[:, :length],
                      attention_mask=chains.mask[:, :, :length, :length]).last_hidden_state
    b, k, s = chains.nodes.shape
    index = chains.nodes.clamp(max=length - 1).reshape(b, k * s, 1).expand(-1, -1, out.shape[-1])
    return out.gather(1, index).view(b, k, s, -1)


@torch.no_grad()
def propose(draft, chains: ChainLayout, token_ids: torch.Tensor | None, temperature: float,
            generator: torch.Generator) -> None:
    """Fill the chain tokens with the draft's own proposals, level by level: argmax on even rows, a sample at
    `temperature` on odd rows (`token_ids`: the target ids of a reduced head's columns)."""
    b, k, s = chains.nodes.shape
    t = chains.input_ids.shape[1] - (k - 1) * s
    sampled_rows = (torch.arange(b) % 2 == 1).to(chains.input_ids.device)
    for j in range(1, k):
        logits = head_logits(draft, node_hidden(draft, chains, upto=t + (j - 1) * s)[:, j - 1]).float()
        greedy = logits.argmax(-1)
        draws = torch.multinomial(torch.softmax(logits / temperature, -1).view(b * s, -1).cpu(), 1,
                                  generator=generator).view(b, s).to(greedy.device)
        columns = torch.where(sampled_rows[:, None], draws, greedy)
        tokens = columns if token_ids is None else token_ids.to(columns.device)[columns]
        chains.input_ids[:, t + (j - 1) * s : t + j * s] = tokens


def chain_window(chains: ChainLayout, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A feature draft's unroll over the layout's chains: where each row's window starts (`window_start`) and, [B, S],
    each chain start p's index in it: step j at index p − 1 proposes the (j + 1)-th token past p
    (`FeatureDraft.unroll`: index i predicts token i + 2 + j)."""
    first = window_start(loss_mask, chains.nodes.shape[1])
    return first, (chains.starts - 1 - first[:, None]).clamp(min=0)


@torch.no_grad()
def propose_features(draft: FeatureDraft, batch: dict, chains: ChainLayout, token_ids: torch.Tensor | None,
                     temperature: float, generator: torch.Generator) -> torch.Tensor:
    """`propose` for a feature draft: its unroll from every index, each step fed the draft's own proposal of the step
    before (argmax on even rows, a sample at `temperature` on odd rows) where training feeds the response's token.
    Fills the layout's chain tokens; returns the tokens fed to steps 1..k − 1 [k − 1, B, R], which training feeds
    again (`distill.step.FeatureStepLogits`)."""
    b, k, s = chains.nodes.shape
    t = chains.input_ids.shape[1] - (k - 1) * s
    device = chains.input_ids.device
    first, offsets = chain_window(chains, batch["loss_mask"].to(device))
    sampled_rows = (torch.arange(b, device=device) % 2 == 1)[:, None]
    fed = []

    def own(j: int, hidden: torch.Tensor) -> torch.Tensor:
        logits = draft.logits(hidden).float()  # [B, R, V_draft]
        draws = torch.multinomial(torch.softmax(logits / temperature, -1).flatten(0, 1).cpu(), 1, generator=generator)
        columns = torch.where(sampled_rows, draws.view(logits.shape[:2]).to(device), logits.argmax(-1))
        tokens = columns if token_ids is None else token_ids.to(device)[columns]
        at_starts = tokens.gather(1, offsets.clamp(max=tokens.shape[1] - 1))
        chains.input_ids[:, t + (j - 1) * s : t + j * s] = at_starts
        fed.append(tokens)
        return tokens

    draft.unroll(batch["features"].to(device), batch["input_ids"].to(device), batch["attention_mask"].to(device), k,
                 first=first, fed=own)
    return torch.stack(fed)


def chain_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor, chains: ChainLayout, d: DistillConfig, *,
               token_ids: torch.Tensor | None, num_tokens: int | torch.Tensor) -> torch.Tensor:
    """`d.loss` at every valid node, each weighted by the chance its chain reaches it, over `num_tokens`.
    draft_logits [N, V_draft] and target_logits [N, V_target] at the valid nodes, in `chains.valid` order."""
    valid = chains.valid.to(draft_logits.device)
    with torch.no_grad():
        alpha = torch.zeros(valid.shape, device=draft_logits.device)
        alpha[valid] = acceptance_rate(draft_logits, target_logits, token_ids=token_ids)
        reached = torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), alpha[:, :-1]], 1), 1)
    return distillation_loss(draft_logits, target_logits, loss=d.loss, beta=d.jsd_beta, token_ids=token_ids,
                             num_tokens=num_tokens, weights=reached[valid])


def valid_logits(model, chains: ChainLayout) -> torch.Tensor:
    """`model`'s logits at the layout's valid nodes, [N, V] in `chains.valid` order."""
    return head_logits(model, node_hidden(model, chains)[chains.valid.to(chains.input_ids.device)])


def chain_batch(batch: dict, draft, d: DistillConfig, token_ids: torch.Tensor | None, seed: int) -> dict:
    """A collated batch with the draft's chains of `d.onpolicy_k` laid out after every row (`batch["chains"]`); for a
    feature draft (its batch carries the target's features) also the tokens its steps were fed (`batch["fed"]`)."""
    check_attention(draft.config)
    device = next(draft.parameters()).device
    dtype = draft.get_input_embeddings().weight.dtype  # the target's: a feature draft shares its embeddings
    chains = layout(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], d.onpolicy_k, dtype).to(device)
    generator = torch.Generator().manual_seed(seed)
    was_training = draft.training
    draft.eval()
    try:
        if isinstance(draft, FeatureDraft):
            fed = propose_features(draft, batch, chains, token_ids, d.onpolicy_temperature, generator)
            return {**batch, "chains": chains, "fed": fed}
        propose(draft, chains, token_ids, d.onpolicy_temperature, generator)
    finally:
        draft.train(was_training)
    return {**batch, "chains": chains}


def check_attention(config) -> None:
    """The layout's mask is one full-attention mask: a family with sliding-window layers would need one per type."""
    if set(layer_windows(config)) != {FULL}:
        raise ValueError("distill.onpolicy_steps: the chain stage supports drafts of full-attention layers only")

"""Greedy decoding of a batch of sequences, with and without a draft model: what a serving engine's batch costs.

`draftops sweep` predicts the speedup of speculation by batch size from costs measured per batch
(`decode.step_costs.measure_batch_costs`); these decode a batch for real, to check that prediction
(`decode.measure.sweep_axes.measure_batches`). Both run the lean forward of a batch. Every sequence of a batch takes
its own rounds: it accepts as many drafted tokens as match the target's greedy tokens, so the sequences go on at
different lengths (`decode.runtime.lean.LeanDecoder.forward_ragged`), and the batch runs until every sequence has its
tokens (static batching: a finished sequence rides along). Greedy and lossless: each sequence gets what
`batched_greedy` gives it. The single-sequence decoder (`decode.speculative`) stays the one draftops decodes with;
this is its batched check. """

from __future__ import annotations

from collections.abc import Sequence

import torch

from decode.runtime.lean import LeanDecoder, require_lean
from decode.runtime.timing import timed


def _lean(model) -> LeanDecoder:
    require_lean(model, "batched decoding")
    return LeanDecoder(model)


@torch.inference_mode()
def batched_greedy(target, prompts: Sequence[list[int]], new_tokens: int) -> tuple[list[list[int]], dict]:
    """`new_tokens` greedy tokens (EOS ignored) after each of `prompts` (all of one length), one batched step each ->
    (outputs, stats: `decode_s`, the seconds after the prompts' prefill)."""
    lean = _lean(target)
    device = next(target.parameters()).device
    tokens = torch.tensor([list(p) for p in prompts], device=device)
    cache = lean.new_cache(len(prompts))
    first = lean.forward_batch(tokens, cache, 0, True)[:, -1].argmax(-1)

    def decode() -> list[list[int]]:
        out = [first]
        for i in range(1, new_tokens):
            out.append(lean.forward_batch(out[-1][:, None], cache, tokens.shape[1] + i - 1, True)[:, -1].argmax(-1))
        return torch.stack(out, 1).tolist()

    outputs, seconds = timed(decode, device)
    return outputs, {"decode_s": seconds}


@torch.inference_mode()
def batched_speculative(target, draft, prompts: Sequence[list[int]], new_tokens: int, gamma: int,
                        draft_token_ids: torch.Tensor | None = None) -> tuple[list[list[int]], dict]:
    """`new_tokens` greedy tokens after each of `prompts` (all of one length, at least 3 tokens), the draft model
    proposing γ a round for every sequence and the target verifying them in one batched pass -> (outputs, stats:
    rounds, drafted and accepted tokens over the batch, `decode_s` the seconds after the prompts' prefill).
    `draft_token_ids`: the target ids of a reduced-vocabulary draft's head rows.

    Caches: the target's holds every token of a sequence but its last (the one the round feeds first); the draft's
    all but its last two, which a round feeds again (recomputing one slot keeps every row's feed the same size
    whether its last round accepted all γ drafts, whose last the draft never fed, or not).
    """
    t, d = _lean(target), _lean(draft)
    device = next(target.parameters()).device
    batch, length = len(prompts), len(prompts[0])
    if length < 3 or any(len(p) != length for p in prompts):
        raise ValueError("batched speculation takes prompts of one length, at least 3 tokens")
    to_target = (lambda ids: ids) if draft_token_ids is None else (lambda ids: draft_token_ids.to(device)[ids])
    prompt = torch.tensor([list(p) for p in prompts], device=device)
    target_cache, draft_cache = t.new_cache(batch), d.new_cache(batch)
    t.forward_batch(prompt[:, :-1], target_cache, 0, False)
    d.forward_batch(prompt[:, :-2], draft_cache, 0, False)
    seqs = [list(p) for p in prompts]
    stats = {"rounds": 0, "drafted": 0, "accepted": 0}

    def decode() -> None:
        while min(len(s) for s in seqs) - length < new_tokens:
            speculate_round()

    def speculate_round() -> None:
        lengths = torch.tensor([len(s) for s in seqs], device=device)
        fed = torch.tensor([s[-2:] for s in seqs], device=device)
        proposals = [to_target(d.forward_ragged(fed, draft_cache, lengths - 2)[:, -1].argmax(-1))]
        for k in range(1, gamma):
            logits = d.forward_ragged(proposals[-1][:, None], draft_cache, lengths + k - 1)
            proposals.append(to_target(logits[:, -1].argmax(-1)))
        drafts = torch.stack(proposals, 1)  # [B, γ]
        block = torch.cat([torch.tensor([s[-1] for s in seqs], device=device)[:, None], drafts], 1)
        greedy = t.forward_ragged(block, target_cache, lengths - 1).argmax(-1)  # the target's token after each
        matched = (drafts == greedy[:, :-1]).int().cumprod(1).sum(1).tolist()
        for seq, row_drafts, row_greedy, a in zip(seqs, drafts.tolist(), greedy.tolist(), matched):
            seq += row_drafts[:a] + [row_greedy[a]]
        stats.update(rounds=stats["rounds"] + 1, drafted=stats["drafted"] + batch * gamma,
                     accepted=stats["accepted"] + sum(matched))

    stats["decode_s"] = timed(decode, device)[1]
    return [s[length : length + new_tokens] for s in seqs], stats

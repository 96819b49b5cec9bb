import math
from collections import Counter

import pytest
import torch

from decode.acceptance import (
    alpha_by_target_confidence,
    analytic_acceptance,
    expected_tokens,
    expected_tokens_from_positions,
    greedy_block,
    sampled_block,
    simulated_tau,
    walk,
)
from decode.factory import model_decoder
from decode.sampling import to_target_vocab, warp_logits
from pipeline.intervals import ratio_ci

SEQUENCES = [[5, 9, 17, 33, 2, 64, 7], [1, 2, 3], [100, 101, 7, 8, 9, 10, 11, 12, 13]]
STARTS = [3, 1, 9]  # the last sequence has an empty response


@torch.no_grad()
def alpha_by_hand(target, draft, seq, start, token_ids=None, **warp):
    """Σ_x min(p, q) one sequence at a time, without padding."""
    ids = torch.tensor([seq])
    p = warp_logits(target(ids).logits[0], **warp)
    q = to_target_vocab(warp_logits(draft(ids).logits[0], **warp), token_ids, p.shape[-1])
    return torch.minimum(p, q).sum(-1)[start - 1 : len(seq) - 1].tolist()


@pytest.mark.parametrize("warp", [dict(temperature=1.0), dict(temperature=0.7, top_k=10, top_p=0.9)])
def test_matches_unpadded_computation(target, close_draft, warp):
    result = analytic_acceptance(target, close_draft, SEQUENCES, STARTS, batch_size=2, **warp)
    for seq, start, values in zip(SEQUENCES, STARTS, result.per_position):
        assert values == pytest.approx(alpha_by_hand(target, close_draft, seq, start, **warp), abs=1e-9)
    assert result.counts == [4, 2, 0]
    assert result.per_sequence[0] == pytest.approx(sum(result.per_position[0]) / 4)
    assert math.isnan(result.per_sequence[2])
    alone = analytic_acceptance(target, close_draft, SEQUENCES[:1], STARTS[:1], **warp)  # prompt logits skipped
    assert alone.per_position[0] == pytest.approx(result.per_position[0], abs=1e-9)
    assert all(0.0 <= a <= 1.0 for a in result.per_position[0]) and min(result.per_position[0]) < 1.0


def test_reduced_vocab_draft(target, reduced_draft):
    draft, token_ids = reduced_draft
    result = analytic_acceptance(target, draft, SEQUENCES[:2], STARTS[:2], draft_token_ids=token_ids)
    expected = alpha_by_hand(target, draft, SEQUENCES[0], STARTS[0], token_ids, temperature=1.0)
    assert result.per_position[0] == pytest.approx(expected, abs=1e-9)


def test_identical_draft_has_alpha_one_and_greedy_is_argmax_agreement(target, close_draft):
    assert analytic_acceptance(target, target, SEQUENCES, STARTS).per_sequence[:2] == pytest.approx([1.0, 1.0])
    greedy = analytic_acceptance(target, close_draft, SEQUENCES, STARTS, temperature=0.0)
    with torch.no_grad():
        ids = torch.tensor([SEQUENCES[0]])
        agree = (target(ids).logits[0].argmax(-1) == close_draft(ids).logits[0].argmax(-1)).double()
    assert greedy.per_position[0] == agree[2:6].tolist()


def test_mismatched_lengths_raise(target):
    with pytest.raises(ValueError, match="2 sequences but 1 response starts"):
        analytic_acceptance(target, target, SEQUENCES[:2], STARTS[:1])


def test_live_acceptance_agrees_with_analytic(target, close_draft):
    """α̂ = accepted / verified from sampling at temperature 1 vs mean Σ min(p, q) over the text it generated."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (int(n),), generator=generator).tolist() for n in torch.randint(3, 9, (40,))]
    decoder = model_decoder(target, close_draft, 3)
    results = [decoder.generate(p, max_new_tokens=24, temperature=1.0, seed=i) for i, p in enumerate(prompts)]
    live = ratio_ci([r.stats.accepted for r in results], [r.stats.verified for r in results])

    analytic = analytic_acceptance(
        target, close_draft, [p + r.token_ids for p, r in zip(prompts, results)], [len(p) for p in prompts]
    )
    predicted = ratio_ci(analytic.sums, analytic.counts)
    assert live.overlaps(predicted), (live, predicted)
    assert abs(live.value - predicted.value) < 0.06
    assert 0.5 < predicted.value < 0.95

    # the per-position acceptance the decoder logged predicts its τ
    stats = [r.stats for r in results]
    accepted_at = torch.tensor([s.accepted_at for s in stats]).sum(0)
    conditional = (accepted_at / torch.tensor([s.verified_at for s in stats]).sum(0)).tolist()
    tau = sum(s.new_tokens for s in stats) / sum(s.target_calls for s in stats)
    assert expected_tokens_from_positions(conditional, 3) == pytest.approx(tau, rel=0.1)
    assert expected_tokens(predicted.value, 3) == pytest.approx(tau, rel=0.15)


def test_target_confidence_is_the_targets_top_probability(target, close_draft):
    result = analytic_acceptance(target, close_draft, SEQUENCES, STARTS, batch_size=2, temperature=0.0)
    with torch.no_grad():
        top = target(torch.tensor([SEQUENCES[0]])).logits[0].softmax(-1).amax(-1)
    assert result.target_confidence[0] == pytest.approx(top[2:6].tolist(), abs=1e-6)
    assert [len(c) for c in result.target_confidence] == result.counts == [4, 2, 0]


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_outside_vocabulary_is_the_targets_probability_on_ids_the_draft_lacks(target, close_draft, reduced_draft,
                                                                              temperature):
    draft, token_ids = reduced_draft
    result = analytic_acceptance(target, draft, SEQUENCES[:2], STARTS[:2], draft_token_ids=token_ids,
                                 temperature=temperature)
    with torch.no_grad():
        p = warp_logits(target(torch.tensor([SEQUENCES[0]])).logits[0], temperature=temperature)[2:6]
    lacked = torch.ones(p.shape[-1], dtype=torch.bool)
    lacked[token_ids] = False
    assert result.outside_vocabulary[0] == pytest.approx(p[:, lacked].sum(-1).tolist(), abs=1e-6)
    if temperature == 0:  # greedy: 1 exactly where the target's token is one the draft cannot propose
        assert result.outside_vocabulary[0] == [float(lacked[t]) for t in p.argmax(-1)]
    assert all(a <= 1 - o + 1e-9 for a, o in zip(result.per_position[0], result.outside_vocabulary[0]))
    assert [len(o) for o in result.outside_vocabulary] == result.counts
    full = analytic_acceptance(target, close_draft, SEQUENCES, STARTS, temperature=temperature)
    assert full.outside_vocabulary == [[0.0] * n for n in full.counts]


def test_alpha_by_target_confidence_by_hand():
    per_position = [[1.0, 0.0, 1.0], [0.0, 1.0]]
    confidence = [[0.3, 0.45, 0.5], [0.9, 1.0]]  # 0.5 opens the middle band; 1.0 falls in the last, closed one
    bands = alpha_by_target_confidence(per_position, confidence)
    assert [(b["low"], b["high"], b["tokens"]) for b in bands] == [(0.0, 0.5, 2), (0.5, 0.8, 1), (0.8, 1.0, 2)]
    assert [b["alpha"] for b in bands] == [0.5, 1.0, 0.5]
    assert [b["share"] for b in bands] == [0.4, 0.2, 0.4]
    empty = alpha_by_target_confidence([[1.0]], [[0.95]], edges=(0.5,))
    assert math.isnan(empty[0]["alpha"]) and empty[1]["alpha"] == 1.0 and empty[0]["tokens"] == 0
    with pytest.raises(ValueError, match="2 α values but 1 confidences"):
        alpha_by_target_confidence([[1.0, 0.0]], [[0.5]])


# The walk: speculative rounds replayed over per-token outcomes, on hand-computed cases. Its agreement with
# `SpeculativeDecoder` round by round is tested in test_sweep.py (test_walk_gives_the_decoders_exact_counts).


class ScriptedDraws:
    """An rng whose random() returns the given values in order."""

    def __init__(self, values):
        self.values, self.used = list(values), 0

    def random(self) -> float:
        self.used += 1
        return self.values[self.used - 1]


def test_greedy_walk_by_hand():
    # γ=3 over 6 tokens. Round 1 (t=0) drafts 3, matches at 0 and 1, not at 2: 2 accepted, 3 verified, t=3.
    # Round 2 (t=3) drafts min(3, 6-3-1) = 2 (the last token is the target's own), both match: t=6.
    w = walk(greedy_block([1, 1, 0, 1, 1, 1]), 6, 3)
    assert (w.calls, w.drafted, w.verified, w.accepted) == (2, 5, 5, 4)
    assert w.rounds == Counter({3: 1, 2: 1})
    # the last token is never drafted, so its match does not matter
    assert walk(greedy_block([1, 1, 0, 1, 1, 0]), 6, 3) == w


def test_walk_edges():
    # one token: a round that drafts nothing and takes the target's token
    w = walk(greedy_block([1]), 1, 4)
    assert (w.calls, w.drafted, w.verified, w.accepted, w.rounds) == (1, 0, 0, 0, Counter({0: 1}))
    # nothing accepted: one call per token, each round but the last verifying its one draft
    w = walk(greedy_block([0] * 4), 4, 2)
    assert (w.calls, w.drafted, w.verified, w.accepted) == (4, 2 + 2 + 1 + 0, 3, 0)
    assert walk(greedy_block([]), 0, 3).calls == 0


def test_sampled_block_draws_once_per_test_and_never_for_the_last_token():
    # alphas 0.5, γ=3, 5 tokens. Round 1: 0.1 < 0.5 accepts, 0.6 rejects (2 draws), t=2. Round 2 drafts
    # min(3, 5-2-1) = 2: 0.3 and 0.2 accept, t=5. Four draws in all: the fifth value is never used.
    draws = ScriptedDraws([0.1, 0.6, 0.3, 0.2, 0.0])
    w = walk(sampled_block([0.5] * 5, draws), 5, 3)
    assert (w.calls, w.drafted, w.verified, w.accepted) == (2, 5, 4, 3)
    assert draws.used == 4


def test_simulated_tau_by_hand():
    assert simulated_tau([[1.0] * 12], gamma=5) == 6.0  # rounds at t=0 and t=6 accept 5 each, + 1
    # γ=2 over [1, 0, 1, 1]: round 1 accepts 1 then rejects (t=2); round 2 drafts 1, accepted, + 1 (t=4)
    assert simulated_tau([[1.0, 0.0, 1.0, 1.0]], gamma=2) == 2.0
    assert simulated_tau([[0.0] * 5], gamma=4) == 1.0
    # pooled: 3 tokens in 1 call + 2 tokens in 2 calls
    assert simulated_tau([[1.0, 1.0, 1.0], [0.0, 0.0]], gamma=2) == 5 / 3
    assert math.isnan(simulated_tau([[]], gamma=3)) and math.isnan(simulated_tau([], gamma=3))


def test_simulated_tau_with_probabilities():
    # 2 tokens: one round drafting token 0 (accepted w.p. 0.5: done in 1 call, else 2). E[calls] = 1.5, τ → 2 / 1.5.
    # Token 1 is never drafted: its α changes nothing, not even the draws.
    assert simulated_tau([[0.5, 0.3]], 2, rollouts=4000) == pytest.approx(4 / 3, rel=0.03)
    assert simulated_tau([[0.5, 0.3]], 2, seed=3) == simulated_tau([[0.5, 0.9]], 2, seed=3)
    assert simulated_tau([[0.5, 0.3]], 2, seed=3) == simulated_tau([[0.5, 0.3]], 2, seed=3)
    # long responses approach Leviathan's closed form
    assert simulated_tau([[0.5] * 400], 3, rollouts=50) == pytest.approx(expected_tokens(0.5, 3), rel=0.05)

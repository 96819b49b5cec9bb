"""The walk: speculative rounds replayed over per-token outcomes, on hand-computed cases.

Its agreement with `SpeculativeDecoder` round by round is tested in test_sweep.py
(test_walk_gives_the_decoders_exact_counts).
"""

import math
from collections import Counter

import pytest

from decode.acceptance import expected_tokens, greedy_block, sampled_block, simulated_tau, walk


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

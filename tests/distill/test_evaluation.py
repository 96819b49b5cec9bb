import pytest

from distill.evaluation import simulated_tau


def test_simulated_tau_walks_blocks_of_gamma():
    assert simulated_tau([[1.0] * 12], gamma=5) == 6.0  # two calls of 5 accepted + 1
    # γ=2 over [1, 0, 1, 1]: call 1 accepts 1 then rejects (2 tokens), call 2 accepts the last 2 (2 tokens left)
    assert simulated_tau([[1.0, 0.0, 1.0, 1.0]], gamma=2) == 2.0
    assert simulated_tau([[0.0] * 5], gamma=4) == 1.0
    mixed = simulated_tau([[0.5] * 400], gamma=3, rollouts=50)
    assert mixed == pytest.approx((1 - 0.5 ** 4) / (1 - 0.5), rel=0.05)  # Leviathan's closed form

import math

import numpy as np
import pytest

from decode.acceptance import expected_speedup, expected_tokens, expected_tokens_from_positions
from decode.stats import GenerationStats, acceptance_ci, aggregate_stats, ratio_ci


def test_record_block_counts_trials_and_positions():
    stats = GenerationStats()
    stats.record_block(3, 1)  # accept, reject, (never tested)
    stats.record_block(3, 3)  # all accepted: 3 trials
    stats.record_block(2, 0)
    assert (stats.drafted, stats.accepted, stats.verified, stats.target_calls) == (8, 4, 6, 3)
    assert stats.drafted_at == [3, 3, 2] and stats.accepted_at == [2, 1, 1] and stats.verified_at == [3, 2, 1]
    stats.new_tokens = 7
    assert stats.tau == 7 / 3
    assert stats.acceptance_rate == 4 / 6
    assert stats.draft_efficiency == 4 / 8


def test_to_dict_has_derived_fields():
    stats = GenerationStats(new_tokens=10, total_s=2.0, draft_s=0.5, verify_s=1.0, prefill_s=0.25, target_calls=4)
    d = stats.to_dict()
    assert d["tokens_per_s"] == 5.0 and d["overhead_s"] == 0.25 and d["tau"] == 2.5
    assert math.isnan(d["acceptance_rate"])


def test_ratio_ci_is_sum_ratio_with_bootstrap_over_prompts():
    ci = acceptance_ci([1, 9, 5], [10, 10, 10], seed=0)
    assert ci.value == 0.5 and ci.n_prompts == 3
    assert 0.1 <= ci.low < 0.5 < ci.high <= 0.9
    assert ci == acceptance_ci([1, 9, 5], [10, 10, 10], seed=0)  # seeded


def test_ratio_ci_weights_prompts_by_denominator():
    # a ratio estimator, not a mean of per-prompt ratios
    assert ratio_ci([1, 0], [1, 9]).value == 0.1


def test_ratio_ci_degenerate_inputs():
    assert math.isnan(ratio_ci([], []).value)
    assert math.isnan(ratio_ci([0, 0], [0, 0]).value)
    single = ratio_ci([3], [4])
    assert single.value == single.low == single.high == 0.75
    with pytest.raises(ValueError):
        ratio_ci([1, 2], [3])


def test_ratio_ci_covers_truth_for_correlated_prompts():
    rng = np.random.default_rng(1)
    prompt_alpha = rng.beta(4, 2, size=200)  # prompts differ; tokens within a prompt share alpha
    drafted = rng.integers(5, 40, size=200)
    accepted = rng.binomial(drafted, prompt_alpha)
    ci = ratio_ci(accepted, drafted)
    truth = (prompt_alpha * drafted).sum() / drafted.sum()
    assert ci.low < truth < ci.high
    assert ci.high - ci.low < 0.1


def test_aggregate_stats_per_category():
    a = GenerationStats(new_tokens=6, accepted=4, verified=5, drafted=6, target_calls=2, total_s=1.0,
                        accepted_at=[2, 2], verified_at=[2, 2], drafted_at=[2, 2])
    b = GenerationStats(new_tokens=2, accepted=0, verified=2, drafted=4, target_calls=2, total_s=1.0,
                        accepted_at=[0, 0], verified_at=[2, 0], drafted_at=[2, 2])
    summary = aggregate_stats([a, b, a], ["code", "chat", "code"])
    assert summary["acceptance_rate"]["value"] == 8 / 12
    assert summary["tau"]["value"] == 14 / 6
    assert summary["acceptance_at_position"] == [4 / 6, 1.0]
    assert summary["per_category"]["code"]["acceptance_rate"]["value"] == 0.8
    assert summary["per_category"]["chat"]["tau"]["value"] == 1.0


def test_leviathan_closed_forms():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert math.isclose(expected_tokens(0.5, 2), 1 + 0.5 + 0.25)
    assert math.isclose(expected_speedup(0.5, 2, c=0.1, v=1.2), 1.75 / 1.4)
    assert math.isclose(expected_tokens_from_positions([0.5], 2), expected_tokens(0.5, 2))
    assert math.isclose(expected_tokens_from_positions([0.9, 0.5, 0.1], 3), 1 + 0.9 + 0.45 + 0.045)
    with pytest.raises(ValueError):
        expected_tokens_from_positions([], 3)

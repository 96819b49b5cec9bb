import math

import numpy as np
import pytest
from scipy import stats as sps

from decode.acceptance import expected_speedup, expected_tokens, expected_tokens_from_positions
from decode.generation_stats import GenerationStats, aggregate_stats
from pipeline.intervals import RatioCI, bootstrap_ci, paired_speedup, ratio_ci, sum_ratio


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


def scipy_bca(samples, statistic, seed=0, n_resamples=2000):
    """scipy's paired BCa interval, called directly."""
    arrays = [np.asarray(x, dtype=np.float64) for x in samples]
    return sps.bootstrap(arrays, statistic, paired=True, n_resamples=n_resamples, method="BCa",
                         rng=np.random.default_rng(seed)).confidence_interval


def test_ratio_ci_is_sum_ratio_with_a_paired_bca_bootstrap_over_prompts():
    ci = ratio_ci([1, 9, 5], [10, 10, 10], seed=0)
    assert ci.value == 0.5 and ci.n_prompts == 3
    direct = scipy_bca(([1, 9, 5], [10, 10, 10]), sum_ratio)
    assert (ci.low, ci.high) == pytest.approx((direct.low, direct.high))
    # every resample's ratio is a mean of three of 0.1, 0.9, 0.5
    assert 0.1 - 1e-12 <= ci.low < 0.5 < ci.high <= 0.9 + 1e-12
    assert ci == ratio_ci([1, 9, 5], [10, 10, 10], seed=0)  # seeded
    # prompts with nothing to count (0 / 0) take no part in the resampling
    assert ratio_ci([1, 9, 0, 5], [10, 10, 0, 10]) == RatioCI(0.5, ci.low, ci.high, 4)


def test_bootstrap_ci_falls_back_to_percentile_where_bca_is_undefined():
    # constant ratios: every resample gives 0.5, BCa's bias correction and acceleration are 0/0
    constant = bootstrap_ci(sum_ratio, ([1, 2, 3], [2, 4, 6]), paired=True)
    assert (constant.method, constant.low, constant.high) == ("percentile", 0.5, 0.5)
    # two prompts (0.1 and 0.9): resamples give 0.1, 0.5, 0.9 with probability 1/4, 1/2, 1/4
    two = bootstrap_ci(sum_ratio, ([1, 9], [10, 10]), paired=True)
    assert (two.method, two.low, two.high) == ("percentile", 0.1, 0.9)
    assert sorted(set(np.round(two.distribution, 12))) == [0.1, 0.5, 0.9]
    # one prompt: nothing to resample
    one = bootstrap_ci(sum_ratio, ([3], [4]), paired=True)
    assert (one.method, one.low, one.high) == ("none", 0.75, 0.75)
    varied = bootstrap_ci(sum_ratio, ([1, 9, 5], [10, 10, 10]), paired=True)
    assert varied.method == "BCa" and varied.distribution.shape == (2000,)


def test_bootstrap_ci_unpaired_resamples_each_sample_on_its_own():
    def mean_difference(a, b, axis=-1):
        return a.mean(axis) - b.mean(axis)

    a, b = [1.0, 2.0, 4.0, 8.0], [0.0, 1.0, 1.0, 3.0, 5.0]
    ci = bootstrap_ci(mean_difference, (a, b), paired=False, confidence=0.9, seed=4)
    direct = sps.bootstrap((np.array(a), np.array(b)), mean_difference, n_resamples=2000, confidence_level=0.9,
                           method="BCa", rng=np.random.default_rng(4)).confidence_interval
    assert ci.method == "BCa" and (ci.low, ci.high) == pytest.approx((direct.low, direct.high))


def test_paired_speedup():
    # a is exactly twice as fast on every prompt: every resample says 2
    assert paired_speedup([10, 20, 30], [1, 2, 3], [10, 20, 30], [2, 4, 6]) == {
        "value": 2.0, "low": 2.0, "high": 2.0, "n_prompts": 3}
    tokens, fast, slow = [10, 10, 10, 10], [1.0, 2.0, 1.5, 1.2], [2.0, 3.0, 2.5, 2.6]
    result = paired_speedup(tokens, fast, tokens, slow, seed=2)
    assert result["value"] == pytest.approx((40 / 5.7) / (40 / 10.1))

    def speedup(ta, sa, tb, sb, axis=-1):
        return (ta.sum(axis) / sa.sum(axis)) / (tb.sum(axis) / sb.sum(axis))

    direct = scipy_bca((tokens, fast, tokens, slow), speedup, seed=2)
    assert (result["low"], result["high"]) == pytest.approx((direct.low, direct.high))


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

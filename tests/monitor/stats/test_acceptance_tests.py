import numpy as np
import pytest
from scipy import stats as sps

from monitor.stats.acceptance_tests import (
    naive_token_ztest,
    paired_drop_test,
    per_prompt_counts,
    traffic_drift,
    unpaired_drop_test,
)

# Three prompts, hand-computed: baseline 6/10 = 0.6, current 4/10 = 0.4, drop 0.2.
# Linearized ratio u_i = (acc_i - R n_i) / mean(n):  baseline [-0.06, -0.12, 0.18], current [0.06, -0.18, 0.12]
# paired differences [-0.12, 0.06, 0.06]: var (ddof=1) 0.0108, se = sqrt(0.0108 / 3) = 0.06.
BASE_ACC, BASE_N = [1, 2, 3], [2, 4, 4]
CUR_ACC, CUR_N = [1, 1, 2], [2, 4, 4]


def test_paired_delta_matches_hand_computation():
    res = paired_drop_test(BASE_ACC, BASE_N, CUR_ACC, CUR_N, margin=0.08, level=0.05, method="delta")
    assert res.baseline_acceptance == pytest.approx(0.6)
    assert res.current_acceptance == pytest.approx(0.4)
    assert res.drop == pytest.approx(0.2)
    # z = (0.2 - 0.08) / 0.06 = 2
    assert res.p_value == pytest.approx(sps.norm.sf(2.0))  # 0.02275
    assert res.p_value == pytest.approx(0.0227501, abs=1e-6)
    assert res.alarm
    assert res.ci_low == pytest.approx(0.2 - 1.6448536 * 0.06)
    assert res.ci_high == pytest.approx(0.2 + 1.6448536 * 0.06)
    no_alarm = paired_drop_test(BASE_ACC, BASE_N, CUR_ACC, CUR_N, margin=0.15, method="delta")
    assert no_alarm.p_value == pytest.approx(sps.norm.sf(0.05 / 0.06))
    assert not no_alarm.alarm


def test_unpaired_delta_matches_hand_computation():
    # var(u0) = (0.0036 + 0.0144 + 0.0324)/2 = 0.0252; var(u1) = (0.0036 + 0.0324 + 0.0144)/2 = 0.0252
    res = unpaired_drop_test(BASE_ACC, BASE_N, CUR_ACC, CUR_N, margin=0.0, method="delta")
    se = np.sqrt(0.0252 / 3 + 0.0252 / 3)
    assert res.p_value == pytest.approx(sps.norm.sf(0.2 / se))
    assert res.ci_low == pytest.approx(0.2 - sps.norm.ppf(0.95) * se)


def test_naive_ztest_matches_hand_computation():
    res = naive_token_ztest(BASE_ACC, BASE_N, CUR_ACC, CUR_N, margin=0.0)
    se = np.sqrt(0.6 * 0.4 / 10 + 0.4 * 0.6 / 10)  # 0.21909
    assert res.p_value == pytest.approx(sps.norm.sf(0.2 / se))  # 0.1807
    assert res.p_value == pytest.approx(0.18066, abs=1e-4)
    assert res.method == "naive_token_z"


def test_paired_bootstrap_constant_shift_is_exact():
    # Every prompt loses exactly 10% of its drafted tokens: every bootstrap drop is exactly 0.1.
    n = np.array([10, 20, 30, 40])
    acc0 = np.array([8, 12, 21, 30])
    acc1 = acc0 - n // 10
    res = paired_drop_test(acc0, n, acc1, n, margin=0.05, n_bootstrap=999, seed=3)
    assert res.drop == pytest.approx(0.1)
    assert res.ci_low == pytest.approx(0.1) and res.ci_high == pytest.approx(0.1)
    assert res.p_value == pytest.approx(1 / 1000)
    assert res.alarm
    same = paired_drop_test(acc0, n, acc0, n, margin=0.0, n_bootstrap=999)
    assert same.drop == 0.0 and same.p_value == 1.0 and not same.alarm


def test_bootstrap_is_seeded_and_agrees_with_delta():
    rng = np.random.default_rng(0)
    n = rng.integers(32, 96, size=300)
    alpha = rng.beta(6.5, 3.5, size=300)
    acc0 = rng.binomial(n, alpha)
    acc1 = rng.binomial(n, np.clip(alpha - 0.03, 0, 1))
    a = paired_drop_test(acc0, n, acc1, n, margin=0.01, seed=7)
    b = paired_drop_test(acc0, n, acc1, n, margin=0.01, seed=7)
    assert a == b
    d = paired_drop_test(acc0, n, acc1, n, margin=0.01, method="delta")
    assert a.ci_low == pytest.approx(d.ci_low, abs=0.005)
    assert a.ci_high == pytest.approx(d.ci_high, abs=0.005)
    assert a.p_value == pytest.approx(d.p_value, abs=0.02)
    ua = unpaired_drop_test(acc0, n, acc1, n, margin=0.01, seed=7)
    ud = unpaired_drop_test(acc0, n, acc1, n, margin=0.01, method="delta")
    assert ua.ci_low == pytest.approx(ud.ci_low, abs=0.01)
    # pairing removes the between-prompt variance: a much narrower interval
    assert (a.ci_high - a.ci_low) < 0.5 * (ua.ci_high - ua.ci_low)


def test_bootstrap_interval_is_scipys_bca_and_p_value_the_share_of_drops_below_margin():
    rng = np.random.default_rng(1)
    n = rng.integers(20, 60, size=40)
    acc0 = rng.binomial(n, 0.7)
    acc1 = rng.binomial(n, 0.6)
    res = paired_drop_test(acc0, n, acc1, n, margin=0.05, level=0.05, seed=3, n_bootstrap=500)

    def drop(a0, n0, a1, n1, axis=-1):
        return a0.sum(axis) / n0.sum(axis) - a1.sum(axis) / n1.sum(axis)

    data = [np.asarray(x, dtype=np.float64) for x in (acc0, n, acc1, n)]
    direct = sps.bootstrap(data, drop, paired=True, n_resamples=500, confidence_level=0.9, method="BCa",
                           rng=np.random.default_rng(3))
    assert (res.ci_low, res.ci_high) == pytest.approx(tuple(direct.confidence_interval))
    drops = direct.bootstrap_distribution
    assert res.p_value == pytest.approx((1 + np.count_nonzero(drops <= 0.05)) / 501)


def test_per_prompt_rates_with_weights():
    acc, n = per_prompt_counts([0.5, 1.0], [4, 2])
    np.testing.assert_allclose(acc, [2.0, 2.0])
    res = paired_drop_test(acc, n, [1.0, 1.0], n, method="delta")
    assert res.baseline_acceptance == pytest.approx(4 / 6)
    assert res.current_acceptance == pytest.approx(2 / 6)


def test_input_validation():
    with pytest.raises(ValueError, match="same prompts"):
        paired_drop_test([1, 2], [2, 2], [1, 2, 1], [2, 2, 2])
    with pytest.raises(ValueError, match="acc <= n"):
        paired_drop_test([3, 2], [2, 2], [1, 2], [2, 2])
    with pytest.raises(ValueError, match="unknown method"):
        paired_drop_test([1, 2], [2, 2], [1, 2], [2, 2], method="exact")


def test_traffic_drift_hand_computed():
    # p = [.75, .25], q = [.25, .75], m = [.5, .5]
    # JS = .75 log2 1.5 + .25 log2 .5 = 0.188722 bits; PSI = .5 ln 3 + .5 ln 3 = ln 3
    res = traffic_drift({1: 3, 2: 1}, {1: 1, 2: 3}, smoothing=0.0, max_buckets=None, threshold=0.1)
    assert res.js_divergence == pytest.approx(0.75 * np.log2(1.5) - 0.25, abs=1e-9)
    assert res.psi == pytest.approx(np.log(3))
    assert res.drifted and res.n_buckets == 2
    same = traffic_drift([0, 5, 5], {1: 10, 2: 10}, smoothing=0.0)
    assert same.js_divergence == pytest.approx(0.0, abs=1e-12) and same.psi == pytest.approx(0.0)
    assert not same.drifted


def test_traffic_drift_buckets_unseen_tokens_into_other():
    # tokens 7 and 8 are unseen in the reference: they land in "other" and PSI stays finite with smoothing
    res = traffic_drift({1: 10, 2: 10, 3: 1}, {1: 10, 7: 5, 8: 5}, max_buckets=3, smoothing=0.5)
    assert res.n_buckets == 3 and np.isfinite(res.psi) and res.psi > 0


def test_traffic_drift_sampling_noise_below_threshold_shift_above():
    rng = np.random.default_rng(0)
    vocab = 49152
    zipf = 1.0 / np.arange(1, vocab + 1) ** 1.1
    zipf /= zipf.sum()
    ref = np.bincount(rng.choice(vocab, 15000, p=zipf), minlength=vocab)
    same = np.bincount(rng.choice(vocab, 15000, p=zipf), minlength=vocab)
    shifted = np.bincount(rng.choice(vocab, 15000, p=np.roll(zipf, 500)), minlength=vocab)
    assert not traffic_drift(ref, same).drifted
    assert traffic_drift(ref, same).js_divergence < 0.01
    assert traffic_drift(ref, shifted).drifted

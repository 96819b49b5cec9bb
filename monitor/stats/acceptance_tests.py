"""Statistics for the monitor: is the champion draft's acceptance lower than at its baseline?

The prompt is the unit of analysis. Tokens drafted for one prompt share its difficulty, so their
acceptances are correlated; treating every token as an independent Bernoulli trial (see
`naive_token_ztest`) underestimates the variance by roughly the design effect and raises false
alarms far above the nominal level.

Acceptance is the ratio estimator  A = sum_i acc_i / sum_i n_i  over prompts i, where acc_i is the
number of accepted draft tokens (or the sum of analytic per-position alpha) and n_i the number of
drafted tokens (positions) of prompt i. All tests are one-sided:  H0: drop <= margin  versus
H1: drop > margin, with drop = A_baseline - A_current.  `alarm` is True when p_value < level; the
reported interval is the central (1 - 2*level) interval, so its lower end is the one-sided
(1 - level) lower confidence bound. With the delta method `alarm` agrees with `ci_low > margin`;
the bootstrap (`pipeline.intervals.bootstrap_ci`) takes its p-value from the share of resampled drops
at or below the margin and its interval by BCa, whose bias and skew correction can move the
bound a little off that share's quantile.

A serving engine's counters (monitor.fleet.counters) give acceptance per window between two
scrapes, not per prompt: there the window is the unit (`window_drop_test`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
from scipy import stats
from scipy.spatial.distance import jensenshannon

from pipeline.intervals import bootstrap_ci

Method = Literal["bootstrap", "delta"]
ArrayLike = Sequence[float] | np.ndarray


@dataclass(frozen=True)
class DropTest:
    """Result of a one-sided test for a drop in ratio acceptance."""

    method: str
    baseline_acceptance: float
    current_acceptance: float
    drop: float
    ci_low: float
    ci_high: float
    p_value: float
    alarm: bool
    margin: float
    level: float
    n_baseline_prompts: int
    n_current_prompts: int

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TrafficDrift:
    """Distance between reference and current token-frequency distributions."""

    js_divergence: float  # Jensen-Shannon divergence in bits, in [0, 1]
    psi: float  # population stability index (natural log)
    drifted: bool
    threshold: float  # on js_divergence
    n_buckets: int
    n_reference_tokens: int
    n_current_tokens: int

    def to_dict(self) -> dict:
        return asdict(self)


def per_prompt_counts(rates: ArrayLike, weights: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Turn per-prompt mean alpha with weights (e.g. drafted tokens) into (acc, n) for the tests."""
    rates, weights = np.asarray(rates, dtype=np.float64), np.asarray(weights, dtype=np.float64)
    return rates * weights, weights


def _validated(acc: ArrayLike, n: ArrayLike, name: str) -> tuple[np.ndarray, np.ndarray]:
    acc, n = np.asarray(acc, dtype=np.float64), np.asarray(n, dtype=np.float64)
    if acc.ndim != 1 or acc.shape != n.shape:
        raise ValueError(f"{name}: acc and n must be 1-D arrays of equal length, got {acc.shape} and {n.shape}")
    if acc.size < 2:
        raise ValueError(f"{name}: need at least 2 prompts, got {acc.size}")
    if np.any(n < 0) or np.any(acc < 0) or np.any(acc > n + 1e-6 * np.maximum(n, 1)):  # fp sums of alpha
        raise ValueError(f"{name}: need 0 <= acc <= n for every prompt")
    if n.sum() <= 0:
        raise ValueError(f"{name}: no drafted tokens")
    return acc, n


def _ratio(acc: np.ndarray, n: np.ndarray) -> float:
    return float(acc.sum() / n.sum())


def _linearized(acc: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Influence values of the ratio estimator: mean(u) ~ R_hat - R (delta method)."""
    ratio = _ratio(acc, n)
    return (acc - ratio * n) / n.mean()


def _ratios(acc: np.ndarray, n: np.ndarray, axis: int = -1) -> np.ndarray:
    """Ratio acceptance along axis (of bootstrap resamples); a resample without drafted tokens counts as 0."""
    return acc.sum(axis) / np.maximum(n.sum(axis), np.finfo(np.float64).tiny)


def _delta_result(drop: float, se: float, margin: float, level: float) -> tuple[float, float, float]:
    """(p_value, ci_low, ci_high) from a normal approximation."""
    z_level = stats.norm.ppf(1.0 - level)
    if se <= 0.0:
        return (0.0 if drop > margin else 1.0), drop, drop
    p_value = float(stats.norm.sf((drop - margin) / se))
    return p_value, float(drop - z_level * se), float(drop + z_level * se)


def _bootstrap_result(statistic, samples: tuple[np.ndarray, ...], paired: bool, margin: float, level: float,
                      seed: int, n_bootstrap: int) -> tuple[float, float, float]:
    """(p_value, ci_low, ci_high) from a bootstrap of the drop: p is the share of resampled drops <= margin."""
    ci = bootstrap_ci(statistic, samples, paired=paired, confidence=1.0 - 2 * level, n_resamples=n_bootstrap,
                      seed=seed)
    p_value = float((1 + np.count_nonzero(ci.distribution <= margin)) / (ci.distribution.size + 1))
    return p_value, ci.low, ci.high


def paired_drop_test(
    baseline_acc: ArrayLike,
    baseline_n: ArrayLike,
    current_acc: ArrayLike,
    current_n: ArrayLike,
    margin: float = 0.0,
    level: float = 0.05,
    method: Method = "bootstrap",
    seed: int = 0,
    n_bootstrap: int = 2000,
) -> DropTest:
    """Drop in acceptance on the SAME prompts (index i is one prompt in both arrays).

    bootstrap: resample prompts with replacement, keeping each prompt's baseline and current
    values together; delta: normal approximation with the paired linearized ratio.
    """
    return _drop_test(baseline_acc, baseline_n, current_acc, current_n, True, margin, level, method, seed,
                      n_bootstrap)


def unpaired_drop_test(
    baseline_acc: ArrayLike,
    baseline_n: ArrayLike,
    current_acc: ArrayLike,
    current_n: ArrayLike,
    margin: float = 0.0,
    level: float = 0.05,
    method: Method = "bootstrap",
    seed: int = 0,
    n_bootstrap: int = 2000,
) -> DropTest:
    """Drop in acceptance between two independent prompt sets (e.g. baseline vs recent traffic)."""
    return _drop_test(baseline_acc, baseline_n, current_acc, current_n, False, margin, level, method, seed,
                      n_bootstrap)


def _drop_test(baseline_acc: ArrayLike, baseline_n: ArrayLike, current_acc: ArrayLike, current_n: ArrayLike,
               paired: bool, margin: float, level: float, method: Method, seed: int, n_bootstrap: int) -> DropTest:
    """The paired or unpaired test: the same ratio drop, its variance from pairs of one prompt or from two samples."""
    acc0, n0 = _validated(baseline_acc, baseline_n, "baseline")
    acc1, n1 = _validated(current_acc, current_n, "current")
    if paired and acc0.size != acc1.size:
        raise ValueError(f"paired test needs the same prompts: {acc0.size} baseline vs {acc1.size} current")
    a0, a1 = _ratio(acc0, n0), _ratio(acc1, n1)
    drop = a0 - a1
    if method == "delta":
        u0, u1 = _linearized(acc0, n0), _linearized(acc1, n1)
        if paired:
            diffs = u0 - u1
            se = float(np.sqrt(diffs.var(ddof=1) / diffs.size))
        else:
            se = float(np.sqrt(u0.var(ddof=1) / u0.size + u1.var(ddof=1) / u1.size))
        p_value, ci_low, ci_high = _delta_result(drop, se, margin, level)
    elif method == "bootstrap":
        if paired:
            def resampled_drop(acc0, n0, acc1, n1, axis=-1):
                return _ratios(acc0, n0, axis) - _ratios(acc1, n1, axis)

            samples = (acc0, n0, acc1, n1)
        else:
            def resampled_drop(i0, i1, axis=-1):  # resampled prompt indices of each side
                return _ratios(acc0[i0], n0[i0], axis) - _ratios(acc1[i1], n1[i1], axis)

            samples = (np.arange(acc0.size), np.arange(acc1.size))
        p_value, ci_low, ci_high = _bootstrap_result(resampled_drop, samples, paired, margin, level, seed,
                                                     n_bootstrap)
    else:
        raise ValueError(f"unknown method {method!r}")
    return DropTest(method, a0, a1, drop, ci_low, ci_high, p_value, p_value < level, margin, level,
                    acc0.size, acc1.size)


def naive_token_ztest(
    baseline_acc: ArrayLike,
    baseline_n: ArrayLike,
    current_acc: ArrayLike,
    current_n: ArrayLike,
    margin: float = 0.0,
    level: float = 0.05,
) -> DropTest:
    """ANTI-EXAMPLE, do not use for decisions: two-proportion z-test over pooled tokens.

    It treats every drafted token as an independent trial, ignoring that tokens of one prompt
    share its difficulty. Its variance is too small by the design effect, so it alarms far more
    often than `level` when nothing changed. Kept to show that in `draftops monitor simulate`.
    """
    acc0, n0 = _validated(baseline_acc, baseline_n, "baseline")
    acc1, n1 = _validated(current_acc, current_n, "current")
    p0, p1 = _ratio(acc0, n0), _ratio(acc1, n1)
    drop = p0 - p1
    se = float(np.sqrt(p0 * (1 - p0) / n0.sum() + p1 * (1 - p1) / n1.sum()))
    p_value, ci_low, ci_high = _delta_result(drop, se, margin, level)
    return DropTest("naive_token_z", p0, p1, drop, ci_low, ci_high, p_value, p_value < level, margin, level,
                    acc0.size, acc1.size)


TokenCounts = Mapping[int, float] | ArrayLike


def _as_mapping(counts: TokenCounts) -> dict[int, float]:
    if isinstance(counts, Mapping):
        return {int(k): float(v) for k, v in counts.items() if v > 0}
    arr = np.asarray(counts, dtype=np.float64)
    return {int(i): float(arr[i]) for i in np.flatnonzero(arr > 0)}


def bucket_token_counts(
    reference: TokenCounts, current: TokenCounts, max_buckets: int | None = 256
) -> tuple[np.ndarray, np.ndarray]:
    """Align two token-count tables on common buckets.

    With max_buckets, the (max_buckets - 1) most frequent reference tokens get their own bucket
    and every other token (including tokens never seen in the reference) shares an "other"
    bucket; this bounds the small-sample bias of both divergences over a 49k vocabulary.
    """
    ref, cur = _as_mapping(reference), _as_mapping(current)
    if max_buckets is None:
        keys = sorted(ref.keys() | cur.keys())
        return np.array([ref.get(k, 0.0) for k in keys]), np.array([cur.get(k, 0.0) for k in keys])
    if max_buckets < 2:
        raise ValueError("max_buckets must be >= 2 (at least one token bucket plus 'other')")
    kept = sorted(ref, key=lambda k: (-ref[k], k))[: max_buckets - 1]
    kept_set = set(kept)
    ref_other = sum(v for k, v in ref.items() if k not in kept_set)
    cur_other = sum(v for k, v in cur.items() if k not in kept_set)
    ref_vec = np.array([ref[k] for k in kept] + [ref_other])
    cur_vec = np.array([cur.get(k, 0.0) for k in kept] + [cur_other])
    return ref_vec, cur_vec


def traffic_drift(
    reference_token_counts: TokenCounts,
    current_token_counts: TokenCounts,
    threshold: float = 0.05,
    max_buckets: int | None = 256,
    smoothing: float = 0.5,
) -> TrafficDrift:
    """JS divergence (bits) and PSI between token frequencies; `drifted` when JS >= threshold.

    Counts are {token_id: count} or a 1-D array indexed by token id. Buckets empty on both sides
    are dropped; every other bucket gets `smoothing` pseudo-counts so that PSI stays finite when a
    bucket is empty on one side (with smoothing=0 such a bucket makes PSI infinite).
    """
    ref, cur = bucket_token_counts(reference_token_counts, current_token_counts, max_buckets)
    if ref.sum() <= 0 or cur.sum() <= 0:
        raise ValueError("traffic_drift needs tokens on both sides")
    occupied = (ref + cur) > 0
    ref, cur = ref[occupied], cur[occupied]
    p = (ref + smoothing) / (ref + smoothing).sum()
    q = (cur + smoothing) / (cur + smoothing).sum()
    js = float(jensenshannon(p, q, base=2) ** 2)
    psi = float(np.sum((q - p) * np.log(q / p)))
    return TrafficDrift(js, psi, js >= threshold, threshold, int(p.size), int(ref.sum()), int(cur.sum()))


@dataclass(frozen=True)
class PromptAcceptance:
    """Per-prompt acceptance of one draft/target pair: acc[i] accepted (or summed alpha) of n[i] drafted."""

    acc: np.ndarray
    n: np.ndarray

    @classmethod
    def of(cls, acc: ArrayLike, n: ArrayLike) -> PromptAcceptance:
        return cls(np.asarray(acc, dtype=np.float64), np.asarray(n, dtype=np.float64))

    @property
    def acceptance(self) -> float:
        return _ratio(self.acc, self.n)

    def __len__(self) -> int:
        return int(self.acc.size)


@dataclass(frozen=True)
class AcceptanceCheck:
    """The monitor's acceptance evidence, each test run at level / (number of tests) (Bonferroni).

    paired: the champion on the baseline's own prompts, now vs at baseline (the draft/target pair
    changed); unpaired: the champion on recent traffic vs the baseline (the traffic changed).
    """

    paired: DropTest | None
    unpaired: DropTest | None

    @property
    def alarm(self) -> bool:
        return any(t.alarm for t in (self.paired, self.unpaired) if t is not None)

    def to_dict(self) -> dict:
        return {"paired": self.paired and self.paired.to_dict(), "unpaired": self.unpaired and self.unpaired.to_dict(),
                "alarm": self.alarm}


def acceptance_check(
    paired: tuple[PromptAcceptance, PromptAcceptance] | None,
    unpaired: tuple[PromptAcceptance, PromptAcceptance] | None,
    margin: float,
    level: float,
    method: Method = "bootstrap",
    seed: int = 0,
    n_bootstrap: int = 2000,
) -> AcceptanceCheck:
    """Run the paired test (baseline, re-measured on the same prompts) and/or the unpaired test (baseline, recent)."""
    n_tests = (paired is not None) + (unpaired is not None)
    if n_tests == 0:
        raise ValueError("acceptance_check needs a paired or an unpaired comparison")
    per_test = level / n_tests
    paired_test = unpaired_test = None
    if paired is not None:
        base, now = paired
        paired_test = paired_drop_test(base.acc, base.n, now.acc, now.n, margin, per_test, method, seed, n_bootstrap)
    if unpaired is not None:
        base, now = unpaired
        unpaired_test = unpaired_drop_test(base.acc, base.n, now.acc, now.n, margin, per_test, method, seed + 1,
                                           n_bootstrap)
    return AcceptanceCheck(paired_test, unpaired_test)


def window_drop_test(
    baseline_acc: ArrayLike,
    baseline_n: ArrayLike,
    current_acc: ArrayLike,
    current_n: ArrayLike,
    margin: float = 0.0,
    level: float = 0.05,
    max_splits: int = 10000,
    seed: int = 0,
) -> DropTest:
    """Drop in acceptance between two sets of serving windows (acc[j] accepted of n[j] draft tokens in window j), by a
    permutation test with the window as the unit.

    The draft tokens of one window come from a few requests and prompts and are correlated like the tokens of one
    prompt; when nothing changed, it is the windows that are exchangeable. The statistic is the drop of the ratio
    acceptance. H0 (drop <= margin) is tested by raising every current window by `margin` (acc + margin * n) and
    splitting the pooled windows into a baseline and a current set every way there is (or `max_splits` random ways
    when there are more): p is the share of splits whose drop is at least the observed one. With b baseline and c
    current windows there are C(b + c, c) splits, so the smallest p is 1 / C(b + c, c): too few windows can never
    alarm. The interval is the drop minus the (1 - level) and level quantiles of the split drops (the permutation
    distribution inverted under a shift), so that `alarm` agrees with `ci_low > margin` up to ties.
    """
    if min(np.size(baseline_acc), np.size(current_acc)) < 2:
        raise ValueError("window test: need at least 2 baseline and 2 current windows")
    acc0, n0 = _validated(baseline_acc, baseline_n, "baseline windows")
    acc1, n1 = _validated(current_acc, current_n, "current windows")
    a0, a1 = _ratio(acc0, n0), _ratio(acc1, n1)
    drop = a0 - a1
    acc, n = np.concatenate([acc0, acc1 + margin * n1]), np.concatenate([n0, n1])
    n_splits = math.comb(acc.size, acc1.size)
    if n_splits <= max_splits:
        current = np.array(list(itertools.combinations(range(acc.size), acc1.size)))
    else:
        current = np.argsort(np.random.default_rng(seed).random((max_splits, acc.size)), axis=1)[:, :acc1.size]
    acc_c, n_c = acc[current].sum(axis=1), n[current].sum(axis=1)
    tiny = np.finfo(np.float64).tiny
    drops = (acc.sum() - acc_c) / np.maximum(n.sum() - n_c, tiny) - acc_c / np.maximum(n_c, tiny)
    hits = int(np.count_nonzero(drops >= drop - margin - 1e-12))
    # every split enumerated (the observed one among them), or a Monte Carlo p that counts the observed split
    p_value = hits / n_splits if n_splits <= max_splits else (1 + hits) / (1 + max_splits)
    ci_low, ci_high = drop - np.quantile(drops, 1.0 - level), drop - np.quantile(drops, level)
    return DropTest("window_permutation", a0, a1, drop, float(ci_low), float(ci_high), float(p_value),
                    p_value < level, margin, level, acc0.size, acc1.size)

"""The project's one bootstrap and the intervals built on it.

Tokens generated for one prompt are correlated, so every interval treats the prompt as the unit: ratio estimators
(sum of numerators / sum of denominators over prompts) with a seeded bootstrap over prompts. Below every package that
reports a figure with its interval: decode's measurements, distill's evaluation, the monitor's drop tests.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats as sps


@dataclass(frozen=True)
class BootstrapCI:
    """A bootstrap interval of a statistic and the resampled values it came from.

    method: "BCa", "percentile" (BCa is undefined: fewer than 3 observations, or a statistic that does not vary
    over the resamples or the jackknife) or "none" (one observation each: nothing to resample, the interval is the
    point). distribution: the statistic on every resample, e.g. for a bootstrap p-value.
    """

    low: float
    high: float
    method: str
    distribution: np.ndarray


def bootstrap_ci(
    statistic: Callable[..., np.ndarray],
    samples: Sequence[Sequence[float]],
    *,
    paired: bool,
    confidence: float = 0.95,
    n_resamples: int = 2000,
    seed: int = 0,
) -> BootstrapCI:
    """Central `confidence` interval of statistic(*samples) by `scipy.stats.bootstrap`, BCa where it is defined.

    statistic(*arrays, axis) must reduce along `axis` (vectorized over resamples). paired: the samples are columns of
    one table (index i is one prompt in all of them) and are resampled together; otherwise each sample is resampled
    on its own. Seeded: the same inputs and seed give the same interval.
    """
    arrays = [np.asarray(sample) for sample in samples]
    if all(a.size == 1 for a in arrays):
        value = float(statistic(*arrays, axis=-1))
        return BootstrapCI(value, value, "none", np.full(n_resamples, value))
    options = dict(paired=paired, confidence_level=confidence, vectorized=True, axis=-1)
    percentile = sps.bootstrap(arrays, statistic, n_resamples=n_resamples, method="percentile",
                               rng=np.random.default_rng(seed), **options)
    distribution = percentile.bootstrap_distribution
    interval = percentile.confidence_interval
    varies = np.ptp(distribution) > 1e-12 * np.abs(distribution).max()
    if varies and min(a.size for a in arrays) >= 3:
        with warnings.catch_warnings(), np.errstate(invalid="ignore", divide="ignore"):
            warnings.simplefilter("ignore", sps.DegenerateDataWarning)  # a constant jackknife: checked below
            bca = sps.bootstrap(arrays, statistic, n_resamples=0, method="BCa", bootstrap_result=percentile,
                                **options).confidence_interval
        if np.isfinite(bca.low) and np.isfinite(bca.high):
            return BootstrapCI(float(bca.low), float(bca.high), "BCa", distribution)
    return BootstrapCI(float(interval.low), float(interval.high), "percentile", distribution)


def sum_ratio(numerators: np.ndarray, denominators: np.ndarray, axis: int = -1) -> np.ndarray:
    """The ratio estimator sum(num) / sum(den) along axis (a bootstrap statistic)."""
    return numerators.sum(axis) / denominators.sum(axis)


@dataclass(frozen=True)
class RatioCI:
    """A ratio estimate sum(num) / sum(den) with a bootstrap interval over prompts."""

    value: float
    low: float
    high: float
    n_prompts: int

    def to_dict(self) -> dict:
        return asdict(self)

    def overlaps(self, other: RatioCI) -> bool:
        return self.low <= other.high and other.low <= self.high


def ratio_ci(
    numerators: Sequence[float],
    denominators: Sequence[float],
    *,
    confidence: float = 0.95,
    n_boot: int = 2000,
    seed: int = 0,
) -> RatioCI:
    """Ratio estimator sum(num)/sum(den) with a paired bootstrap over prompts (`bootstrap_ci`).

    Prompts with nothing to count (0 / 0) add nothing to either sum and take no part in the resampling.
    """
    num = np.asarray(numerators, dtype=np.float64)
    den = np.asarray(denominators, dtype=np.float64)
    if num.shape != den.shape or num.ndim != 1:
        raise ValueError(f"need two 1-D sequences of equal length, got shapes {num.shape} and {den.shape}")
    if len(num) == 0 or den.sum() <= 0:
        return RatioCI(float("nan"), float("nan"), float("nan"), len(num))
    counted = (num != 0) | (den != 0)
    ci = bootstrap_ci(sum_ratio, (num[counted], den[counted]), paired=True, confidence=confidence,
                      n_resamples=n_boot, seed=seed)
    return RatioCI(float(num.sum() / den.sum()), ci.low, ci.high, len(num))


def paired_ratio_difference(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]], *,
                            seed: int = 0, n_boot: int = 2000) -> dict:
    """Two ratio estimators on the same prompts, a[i] and b[i] each (numerator, denominator) of prompt i: a's ratio,
    b's, their difference and a's over b's, the last two with a paired bootstrap interval over prompts."""
    na, da, nb, db = (np.asarray([row[j] for row in rows], dtype=np.float64) for rows in (a, b) for j in (0, 1))
    out = {"a": float(na.sum() / da.sum()), "b": float(nb.sum() / db.sum())}
    for name, combine in (("difference", np.subtract), ("ratio", np.divide)):
        def statistic(na, da, nb, db, axis=-1, combine=combine):
            return combine(sum_ratio(na, da, axis), sum_ratio(nb, db, axis))
        ci = bootstrap_ci(statistic, (na, da, nb, db), paired=True, n_resamples=n_boot, seed=seed)
        out[name] = {"value": float(statistic(na, da, nb, db)), "low": ci.low, "high": ci.high}
    return out


def paired_speedup(tokens_a, seconds_a, tokens_b, seconds_b, *, seed: int = 0, n_boot: int = 2000) -> dict:
    """Throughput of a over throughput of b on the same prompts, with a paired bootstrap over prompts."""
    ta, sa, tb, sb = (np.asarray(x, dtype=np.float64) for x in (tokens_a, seconds_a, tokens_b, seconds_b))

    def speedup(ta, sa, tb, sb, axis=-1):
        return sum_ratio(ta, sa, axis) / sum_ratio(tb, sb, axis)

    ci = bootstrap_ci(speedup, (ta, sa, tb, sb), paired=True, n_resamples=n_boot, seed=seed)
    return {"value": float(speedup(ta, sa, tb, sb)), "low": ci.low, "high": ci.high, "n_prompts": len(ta)}

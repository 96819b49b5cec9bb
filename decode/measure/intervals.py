"""Per-generation bookkeeping, prompt-level aggregation and the project's one bootstrap.

Tokens generated for one prompt are correlated, so every confidence interval here treats the prompt as the unit:
ratio estimators (sum of numerators / sum of denominators over prompts) with a seeded bootstrap over prompts
(`bootstrap_ci`, also behind the monitor's drop tests).
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np
from scipy import stats as sps

from decode.generation_stats import GenerationStats

if TYPE_CHECKING:
    from decode.chain_acceptance import ChainAcceptance


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


def chain_summary(chain: ChainAcceptance, *, seed: int = 0) -> dict:
    """Chains of k as engines report them (`decode.chain_acceptance`): k, drafts, the rate at each position, and the
    mean acceptance length with its 95% interval over prompts (1 + the bootstrapped accepted / drafts)."""
    ci = ratio_ci([sum(row) for row in chain.accepted], [len(row) for row in chain.accepted], seed=seed)
    return {"k": chain.k, "drafts": chain.drafts, "per_position": chain.per_position, "length": chain.length,
            "length_low": 1 + ci.low, "length_high": 1 + ci.high}


def chain_text(chain: dict) -> str:
    """One line: `k=3 (vLLM's count): 0.73 / 0.52 / 0.35, acceptance length 2.60 [2.51, 2.69]`."""
    rates = " / ".join(f"{rate:.2f}" for rate in chain["per_position"])
    return (f"k={chain['k']} (vLLM's count, per draft): {rates}, acceptance length {chain['length']:.2f} "
            f"[{chain['length_low']:.2f}, {chain['length_high']:.2f}]")


def paired_speedup(tokens_a, seconds_a, tokens_b, seconds_b, *, seed: int = 0, n_boot: int = 2000) -> dict:
    """Throughput of a over throughput of b on the same prompts, with a paired bootstrap over prompts."""
    ta, sa, tb, sb = (np.asarray(x, dtype=np.float64) for x in (tokens_a, seconds_a, tokens_b, seconds_b))

    def speedup(ta, sa, tb, sb, axis=-1):
        return sum_ratio(ta, sa, axis) / sum_ratio(tb, sb, axis)

    ci = bootstrap_ci(speedup, (ta, sa, tb, sb), paired=True, n_resamples=n_boot, seed=seed)
    return {"value": float(speedup(ta, sa, tb, sb)), "low": ci.low, "high": ci.high, "n_prompts": len(ta)}


def acceptance_ci(
    accepted_per_prompt: Sequence[float],
    drafted_per_prompt: Sequence[float],
    *,
    confidence: float = 0.95,
    n_boot: int = 2000,
    seed: int = 0,
) -> RatioCI:
    """Acceptance sum(accepted)/sum(drafted) over prompts with a prompt-level bootstrap CI.

    Pass verified counts (GenerationStats.verified) as the denominator to estimate the per-token α.
    """
    return ratio_ci(accepted_per_prompt, drafted_per_prompt, confidence=confidence, n_boot=n_boot, seed=seed)


def aggregate_stats(
    stats: Sequence[GenerationStats],
    categories: Sequence[str] | None = None,
    *,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict:
    """Aggregate per-prompt stats: α̂, draft efficiency, τ and tokens/s with prompt-level CIs, per category too."""
    summary = _summarize(stats, confidence=confidence, seed=seed)
    if categories is not None:
        if len(categories) != len(stats):
            raise ValueError(f"{len(categories)} categories for {len(stats)} stats")
        summary["per_category"] = {
            name: _summarize([s for s, c in zip(stats, categories) if c == name], confidence=confidence, seed=seed)
            for name in sorted(set(categories))
        }
    return summary


def _summarize(stats: Sequence[GenerationStats], *, confidence: float, seed: int) -> dict:
    def ci(num: list[float], den: list[float]) -> dict:
        return ratio_ci(num, den, confidence=confidence, seed=seed).to_dict()

    depth = max((len(s.drafted_at) for s in stats), default=0)
    accepted_at, verified_at = np.zeros(depth), np.zeros(depth)
    for s in stats:
        accepted_at[: len(s.accepted_at)] += s.accepted_at
        verified_at[: len(s.verified_at)] += s.verified_at
    return {
        "n_prompts": len(stats),
        "new_tokens": sum(s.new_tokens for s in stats),
        "acceptance_rate": ci([s.accepted for s in stats], [s.verified for s in stats]),
        "draft_efficiency": ci([s.accepted for s in stats], [s.drafted for s in stats]),
        "tau": ci([s.new_tokens for s in stats], [s.target_calls for s in stats]),
        "tokens_per_s": ci([s.new_tokens for s in stats], [s.total_s for s in stats]),
        "acceptance_at_position": [float(a / v) if v else float("nan") for a, v in zip(accepted_at, verified_at)],
        "accepted_by_source": dict(sum((Counter(s.accepted_by_source) for s in stats), Counter())),
        "time_s": {
            name: float(sum(getattr(s, name) for s in stats))
            for name in ("prefill_s", "draft_s", "verify_s", "overhead_s", "total_s")
        },
    }

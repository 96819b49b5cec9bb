"""Per-generation bookkeeping and prompt-level aggregation.

Tokens generated for one prompt are correlated, so every confidence interval here treats the prompt as the unit:
ratio estimators (sum of numerators / sum of denominators over prompts) with a seeded bootstrap over prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class GenerationStats:
    """What happened while generating for one prompt.

    `verified` counts draft tokens that met an accept/reject test (drafts after the first rejection never do), so
    accepted / verified estimates the per-token acceptance α, while accepted / drafted is the draft's efficiency.
    Per block position i: `drafted_at[i]` blocks drafted it, `verified_at[i]` tested it (all before it accepted),
    `accepted_at[i]` accepted it; accepted_at[i] / verified_at[i] is the acceptance at position i given that
    position i was reached.
    """

    new_tokens: int = 0
    drafted: int = 0
    verified: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)
    verified_at: list[int] = field(default_factory=list)
    drafted_at: list[int] = field(default_factory=list)
    target_calls: int = 0
    draft_calls: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    stop_reason: str = ""

    def record_block(self, n_drafted: int, n_accepted: int) -> None:
        self.drafted += n_drafted
        self.accepted += n_accepted
        self.verified += min(n_accepted + 1, n_drafted)
        self.target_calls += 1
        grow = n_drafted - len(self.drafted_at)
        if grow > 0:
            for counts in (self.drafted_at, self.verified_at, self.accepted_at):
                counts.extend([0] * grow)
        for i in range(n_drafted):
            self.drafted_at[i] += 1
        for i in range(min(n_accepted + 1, n_drafted)):
            self.verified_at[i] += 1
        for i in range(n_accepted):
            self.accepted_at[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Per-token acceptance α̂ = accepted / verified (nan when nothing was verified)."""
        return self.accepted / self.verified if self.verified else float("nan")

    @property
    def draft_efficiency(self) -> float:
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def tau(self) -> float:
        """Tokens per target call."""
        return self.new_tokens / self.target_calls if self.target_calls else float("nan")

    @property
    def overhead_s(self) -> float:
        return max(0.0, self.total_s - self.prefill_s - self.draft_s - self.verify_s)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else float("nan")

    def to_dict(self) -> dict:
        out = asdict(self)
        for name in ("acceptance_rate", "draft_efficiency", "tau", "overhead_s", "tokens_per_s"):
            out[name] = getattr(self, name)
        return out


@dataclass(frozen=True)
class RatioCI:
    """A ratio estimate sum(num) / sum(den) with a percentile bootstrap interval over prompts."""

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
    """Ratio estimator sum(num)/sum(den) with a bootstrap over prompts (resampling whole prompts)."""
    num = np.asarray(numerators, dtype=np.float64)
    den = np.asarray(denominators, dtype=np.float64)
    if num.shape != den.shape or num.ndim != 1:
        raise ValueError(f"need two 1-D sequences of equal length, got shapes {num.shape} and {den.shape}")
    if len(num) == 0 or den.sum() <= 0:
        return RatioCI(float("nan"), float("nan"), float("nan"), len(num))
    value = float(num.sum() / den.sum())
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(num), size=(n_boot, len(num)))
    boot_den = den[picks].sum(1)
    valid = boot_den > 0
    boot = num[picks].sum(1)[valid] / boot_den[valid]
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(boot, [tail, 100 - tail])
    return RatioCI(value, float(low), float(high), len(num))


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
        "time_s": {
            name: float(sum(getattr(s, name) for s in stats))
            for name in ("prefill_s", "draft_s", "verify_s", "overhead_s", "total_s")
        },
    }

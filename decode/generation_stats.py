"""What one generation did, round by round: tokens proposed and accepted per source, target calls, timings
(`GenerationStats`), and their aggregate over prompts with intervals (`aggregate_stats`)."""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from pipeline.intervals import ratio_ci


@dataclass
class GenerationStats:
    """What happened while generating for one prompt.

    `verified` counts draft tokens that met an accept/reject test (drafts after the first rejection never do), so
    accepted / verified estimates the per-token acceptance α, while accepted / drafted is the draft's efficiency.
    Per block position i: `drafted_at[i]` blocks drafted it, `verified_at[i]` tested it (all before it accepted),
    `accepted_at[i]` accepted it; accepted_at[i] / verified_at[i] is the acceptance at position i given that
    position i was reached. In a tree round (`decode.speculative.tree_round`) `drafted` counts the tree's nodes, a
    position is drafted when the tree reaches that depth and verified when the walk tested candidates there, so
    accepted / verified stays the per-position acceptance; `accepted_by_source` counts the accepted tokens by the tree
    source that proposed them (chain rounds do not label theirs).
    """

    new_tokens: int = 0
    drafted: int = 0
    verified: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)
    verified_at: list[int] = field(default_factory=list)
    drafted_at: list[int] = field(default_factory=list)
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    target_calls: int = 0
    draft_calls: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    stop_reason: str = ""

    def record_block(self, n_drafted: int, n_accepted: int) -> None:
        """A chain round: n_drafted drafts, the first n_accepted accepted (the next one, if any, was tested)."""
        self.record_round(n_drafted, n_drafted, min(n_accepted + 1, n_drafted), n_accepted)

    def record_round(self, drafted: int, depth: int, tested: int, accepted: int, sources: Sequence[str] = ()) -> None:
        """One target call over `drafted` candidates `depth` positions deep, with tests at the first `tested`
        positions and `accepted` tokens accepted (`sources`: the source of each, where known)."""
        self.drafted += drafted
        self.accepted += accepted
        self.verified += tested
        self.target_calls += 1
        grow = depth - len(self.drafted_at)
        if grow > 0:
            for counts in (self.drafted_at, self.verified_at, self.accepted_at):
                counts.extend([0] * grow)
        for counts, n in ((self.drafted_at, depth), (self.verified_at, tested), (self.accepted_at, accepted)):
            for i in range(n):
                counts[i] += 1
        for source in sources:
            self.accepted_by_source[source] = self.accepted_by_source.get(source, 0) + 1

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


class PhaseClock:
    """Times one generation's phases into its stats: `clock("draft")` adds the seconds since the last mark to
    `stats.draft_s` (after `sync`, which waits for the device); `restart()` marks without charging a phase (what
    falls between phases is overhead); `total()` is the seconds since the clock started."""

    def __init__(self, stats: GenerationStats, sync: Callable[[], None]):
        self.stats, self.sync = stats, sync
        sync()
        self.started = self.mark = time.perf_counter()

    def __call__(self, phase: str) -> None:
        self.sync()
        now = time.perf_counter()
        setattr(self.stats, f"{phase}_s", getattr(self.stats, f"{phase}_s") + now - self.mark)
        self.mark = now

    def restart(self) -> None:
        self.mark = time.perf_counter()

    def total(self) -> float:
        self.sync()
        return time.perf_counter() - self.started


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

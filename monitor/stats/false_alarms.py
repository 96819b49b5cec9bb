"""How often does the monitor's check alarm when nothing changed, and how often does it catch a drop?

Each simulated check mirrors `monitor.check.run`: a baseline measured on N held-out prompts, the same
prompts re-measured now (paired test) and N other recent prompts measured now (unpaired test),
combined by `stats.acceptance_check` at the configured level. Prompts come either from real
per-prompt (accepted, drafted) pairs, resampled with replacement, or from a beta-binomial model:
prompt i has its own alpha_i ~ Beta (heterogeneity between prompts), and one measurement of it
draws a continuation rate theta ~ Beta around alpha_i shared by all its drafted tokens
(correlation within a prompt). A drop of d lowers every prompt's alpha by d.

The window test of the serving engines' counters is simulated in monitor.stats.window_simulation.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from scipy import stats as sps

from monitor.stats.acceptance_tests import Method, PromptAcceptance, acceptance_check, naive_token_ztest

_EPS = 1e-4


@dataclass(frozen=True)
class BetaBinomialTraffic:
    """Synthetic per-prompt acceptance; the defaults give a between-prompt SD of alpha of about 0.18."""

    mean_alpha: float = 0.65
    prompt_concentration: float = 6.0  # alpha_i ~ Beta(m k, (1 - m) k)
    continuation_concentration: float = 30.0  # theta ~ Beta(alpha_i c, (1 - alpha_i) c) per measurement
    min_drafted: int = 32
    max_drafted: int = 128

    def draw_prompts(self, rng: np.random.Generator, k: int) -> tuple[np.ndarray, np.ndarray]:
        m, c = self.mean_alpha, self.prompt_concentration
        alpha = rng.beta(m * c, (1 - m) * c, size=k)
        drafted = rng.integers(self.min_drafted, self.max_drafted + 1, size=k)
        return alpha, drafted


def measure(rng: np.random.Generator, alpha: np.ndarray, drafted: np.ndarray, continuation_concentration: float,
            drop: float = 0.0) -> PromptAcceptance:
    """One measurement of each prompt: a shared continuation rate, then binomial acceptances."""
    mean = np.clip(alpha - drop, _EPS, 1 - _EPS)
    c = continuation_concentration
    theta = rng.beta(mean * c, (1 - mean) * c)
    drafted = np.asarray(drafted).astype(np.int64)
    return PromptAcceptance.of(rng.binomial(drafted, theta), drafted)


def thin(rng: np.random.Generator, values: PromptAcceptance, drop: float) -> PromptAcceptance:
    """Lower each prompt's acceptance by `drop` in expectation by binomially thinning its accepted tokens."""
    if drop == 0.0:
        return values
    rate = values.acc / np.maximum(values.n, 1)
    keep = np.clip(1 - drop / np.maximum(rate, _EPS), 0.0, 1.0)
    return PromptAcceptance.of(rng.binomial(np.rint(values.acc).astype(np.int64), keep), values.n)


def as_json(result) -> dict:
    """A simulation result as JSON: its fields, the power's drops as string keys."""
    out = asdict(result)
    out["power"] = {str(k): v for k, v in result.power.items()}
    return out


class _PowerCurve:
    """What a simulation result with a power curve (`power`: drop -> alarm rate) says of it: JSON with the drops as
    keys, and a summary line a drop."""

    power: dict[float, float]

    def to_dict(self) -> dict:
        out = asdict(self)
        out["power"] = {str(k): v for k, v in self.power.items()}
        return out

    def power_lines(self) -> list[str]:
        return [f"power against a {100 * d:g}-point drop: {p:.3f}" for d, p in self.power.items()]


@dataclass
class SimulationResult(_PowerCurve):
    n_prompts: int
    n_checks: int
    level: float
    margin: float
    method: str
    source: str  # "pairs" (resampled real prompts) or "beta-binomial"
    false_alarm_rate: float
    false_alarm_ci: tuple[float, float]
    paired_false_alarm_rate: float
    unpaired_false_alarm_rate: float
    naive_false_alarm_rate: float  # naive token z-test, baseline vs recent prompts, at `level`
    power: dict[float, float] = field(default_factory=dict)  # drop -> alarm rate

    def summary(self) -> str:
        lo, hi = self.false_alarm_ci
        lines = [
            f"{self.n_checks} simulated checks, N={self.n_prompts} prompts, level={self.level}, margin={self.margin}, "
            f"method={self.method}, prompts from {self.source}",
            f"false alarms when nothing changed: {self.false_alarm_rate:.3f} (95% CI {lo:.3f}-{hi:.3f}; "
            f"paired {self.paired_false_alarm_rate:.3f}, unpaired {self.unpaired_false_alarm_rate:.3f})",
            f"naive token z-test (anti-example) false alarms: {self.naive_false_alarm_rate:.3f}",
        ]
        return "\n".join(lines + self.power_lines())


class _Prompts:
    """Draws baseline / re-measured / recent per-prompt values for one simulated check.

    From real pairs: baseline and recent prompts are resampled observations (recent ones thinned by
    the drop); a re-measurement of a baseline prompt draws a fresh continuation rate around its
    observed rate, since one observation per prompt cannot show its own re-measurement noise.
    """

    def __init__(self, pairs: Sequence[tuple[float, float]] | None, model: BetaBinomialTraffic):
        self.model = model
        self.pool = None
        if pairs is not None:
            arr = np.asarray(pairs, dtype=np.float64)
            if arr.ndim != 2 or arr.shape[1] != 2 or len(arr) < 2:
                raise ValueError("pairs must be a list of at least 2 (accepted, drafted) pairs")
            arr = arr[arr[:, 1] > 0]
            self.pool = PromptAcceptance.of(arr[:, 0], arr[:, 1])

    def draw(self, rng: np.random.Generator, k: int, drop: float):
        c = self.model.continuation_concentration
        if self.pool is None:
            alpha, drafted = self.model.draw_prompts(rng, k)
            baseline = measure(rng, alpha, drafted, c)
            recent_alpha, recent_drafted = self.model.draw_prompts(rng, k)
            recent = measure(rng, recent_alpha, recent_drafted, c, drop)
        else:
            idx = rng.integers(0, len(self.pool), size=k)
            baseline = PromptAcceptance.of(self.pool.acc[idx], self.pool.n[idx])
            alpha, drafted = baseline.acc / baseline.n, baseline.n
            recent_idx = rng.integers(0, len(self.pool), size=k)
            recent = thin(rng, PromptAcceptance.of(self.pool.acc[recent_idx], self.pool.n[recent_idx]), drop)
        remeasured = measure(rng, alpha, drafted, c, drop)
        return baseline, remeasured, recent


def simulate_checks(
    n_prompts: int,
    level: float,
    margin: float,
    drops: Sequence[float] = (0.02, 0.05, 0.10),
    n_checks: int = 200,
    pairs: Sequence[tuple[float, float]] | None = None,
    model: BetaBinomialTraffic = BetaBinomialTraffic(),
    method: Method = "bootstrap",
    n_bootstrap: int = 1000,
    seed: int = 0,
) -> SimulationResult:
    """False-alarm rate (no change) and power (each drop) of the monitor's acceptance check."""
    if n_checks < 1:
        raise ValueError("n_checks must be >= 1")
    rng = np.random.default_rng(seed)
    prompts = _Prompts(pairs, model)

    def one_check(drop: float, i: int):
        baseline, remeasured, recent = prompts.draw(rng, n_prompts, drop)
        check = acceptance_check((baseline, remeasured), (baseline, recent), margin, level, method, seed + i,
                                 n_bootstrap)
        return check, baseline, recent

    null_alarms = paired_alarms = unpaired_alarms = naive_alarms = 0
    for i in range(n_checks):
        check, baseline, recent = one_check(0.0, i)
        null_alarms += check.alarm
        paired_alarms += check.paired.alarm
        unpaired_alarms += check.unpaired.alarm
        naive_alarms += naive_token_ztest(baseline.acc, baseline.n, recent.acc, recent.n, margin, level).alarm
    power = {float(d): sum(one_check(d, i)[0].alarm for i in range(n_checks)) / n_checks for d in drops}
    ci = sps.binomtest(null_alarms, n_checks).proportion_ci(0.95, method="wilson")
    return SimulationResult(
        n_prompts=n_prompts, n_checks=n_checks, level=level, margin=margin, method=method,
        source="pairs" if pairs is not None else "beta-binomial",
        false_alarm_rate=null_alarms / n_checks, false_alarm_ci=(float(ci.low), float(ci.high)),
        paired_false_alarm_rate=paired_alarms / n_checks, unpaired_false_alarm_rate=unpaired_alarms / n_checks,
        naive_false_alarm_rate=naive_alarms / n_checks, power=power)


def power_figure(result: SimulationResult):
    """Alarm rate against the size of the drop (0 = false alarms), with the nominal level marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drops = [0.0, *result.power]
    rates = [result.false_alarm_rate, *result.power.values()]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([100 * d for d in drops], rates, "o-", label="prompt-level check")
    ax.axhline(result.level, color="grey", linestyle="--", label=f"level {result.level}")
    ax.axvline(100 * result.margin, color="grey", linestyle=":", label=f"margin {100 * result.margin:g} pt")
    ax.scatter([0], [result.naive_false_alarm_rate], color="red", marker="x", label="naive token z-test (no change)")
    ax.set_xlabel("true drop in acceptance (points)")
    ax.set_ylabel("alarm rate per check")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"N={result.n_prompts} prompts, {result.n_checks} checks per point")
    ax.legend(fontsize=7, loc="center right")
    fig.tight_layout()
    return fig


def read_pairs(path: str) -> list[tuple[float, float]]:
    """Per-prompt (accepted, drafted): a JSON list of pairs, or an object with 'accepted' and 'drafted' lists of one
    length; at least two pairs of finite numbers, 0 <= accepted <= drafted. ValueError saying what is wrong."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot be read: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"not a JSON file: {exc}") from None
    if isinstance(data, dict):
        if not isinstance(data.get("accepted"), list) or not isinstance(data.get("drafted"), list):
            raise ValueError("an object needs 'accepted' and 'drafted' lists")
        if len(data["accepted"]) != len(data["drafted"]):
            raise ValueError("'accepted' and 'drafted' differ in length")
        data = list(zip(data["accepted"], data["drafted"]))
    if not isinstance(data, list) or len(data) < 2:
        raise ValueError("needs a list of at least two [accepted, drafted] pairs")
    pairs = []
    for i, pair in enumerate(data):
        if (not isinstance(pair, (list, tuple)) or len(pair) != 2
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in pair)
                or not 0 <= pair[0] <= pair[1]):
            raise ValueError(f"pair {i} is {pair!r}: needs two finite numbers, 0 <= accepted <= drafted")
        pairs.append((float(pair[0]), float(pair[1])))
    return pairs

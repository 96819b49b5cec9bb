"""How often does the window test of the serving engines' counters alarm when nothing changed, and how often does it
catch a drop, for a given window length and traffic per window?

Each simulated check runs `window_drop_test` on b baseline and r recent windows, as the check runs it for one replica
(monitor.fleet.verdicts; with R replicas each test runs at level / (R + 1)). Windows are resampled with replacement
from a pool: recorded (accepted, draft tokens) windows, else `pool_size` synthetic ones, each the sum of
`requests_per_window` beta-binomial requests (`false_alarms.BetaBinomialTraffic`: heterogeneity between prompts,
correlation within one). A drop thins the recent windows' accepted tokens.

What an hour of real traffic adds to that, as two optional shifts of a window's acceptance (added to accepted / draft
tokens, clipped to [0, 1]):
- `window_sd`: each window's own shift ~ N(0, window_sd), the mix of traffic changing from one window to the next
  (windows stay exchangeable: the test's false-alarm rate holds, its power falls);
- `daily_amplitude`: a daily cycle, amplitude * sin(2 pi hour / 24), with windows `window_hours` long: the baseline's
  b windows start at a random hour and the recent r end at another (the check runs when its schedule says, the
  baseline was taken when the version became champion), so baseline and recent windows are not exchangeable and the
  false-alarm rate rises above the level; a baseline of a whole day (b * window_hours >= 24) averages the cycle out of
  the baseline, not out of the recent windows.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy import stats as sps

from monitor.stats.acceptance_tests import PromptAcceptance, window_drop_test
from monitor.stats.false_alarms import BetaBinomialTraffic, as_json, measure, thin

TRAFFIC = BetaBinomialTraffic()  # the default synthetic traffic (frozen)


@dataclass
class WindowSimulationResult:
    n_baseline_windows: int
    n_recent_windows: int
    n_checks: int
    level: float
    margin: float
    source: str  # "windows" (resampled recorded windows) or "beta-binomial" (synthetic windows)
    false_alarm_rate: float
    false_alarm_ci: tuple[float, float]
    power: dict[float, float] = field(default_factory=dict)  # drop -> alarm rate
    requests_per_window: int | None = None  # synthetic windows only
    window_sd: float = 0.0
    daily_amplitude: float = 0.0
    window_hours: float = 1.0

    def to_dict(self) -> dict:
        return as_json(self)

    def summary(self) -> str:
        lo, hi = self.false_alarm_ci
        traffic = (f"{self.requests_per_window} requests a window" if self.requests_per_window else "recorded windows")
        cycle = f", daily cycle +-{self.daily_amplitude:g} ({self.window_hours:g} h windows)"
        shifts = (f", window sd {self.window_sd:g}" if self.window_sd else "") + (cycle if self.daily_amplitude else "")
        lines = [f"{self.n_checks} simulated window tests, {self.n_recent_windows} recent vs {self.n_baseline_windows} "
                 f"baseline windows, level={self.level:.4g}, margin={self.margin}, {traffic}{shifts}",
                 f"false alarms when nothing changed: {self.false_alarm_rate:.3f} (95% CI {lo:.3f}-{hi:.3f})"]
        lines += [f"power against a {100 * d:g}-point drop: {p:.3f}" for d, p in self.power.items()]
        return "\n".join(lines)


def synthetic_windows(rng: np.random.Generator, k: int, model: BetaBinomialTraffic = TRAFFIC,
                      requests_per_window: int = 100) -> PromptAcceptance:
    """k serving windows, each the sum of `requests_per_window` requests drawn and measured as by `model`."""
    acc, n = np.empty(k), np.empty(k)
    for start in range(0, k, max(1, 200_000 // requests_per_window)):  # bounded memory for long windows
        size = min(k - start, max(1, 200_000 // requests_per_window))
        alpha, drafted = model.draw_prompts(rng, size * requests_per_window)
        requests = measure(rng, alpha, drafted, model.continuation_concentration)
        acc[start:start + size] = requests.acc.reshape(size, -1).sum(axis=1)
        n[start:start + size] = requests.n.reshape(size, -1).sum(axis=1)
    return PromptAcceptance.of(acc, n)


def _pool(windows: Sequence[tuple[float, float]] | None, rng: np.random.Generator, pool_size: int,
          model: BetaBinomialTraffic, requests_per_window: int) -> PromptAcceptance:
    if windows is None:
        return synthetic_windows(rng, pool_size, model, requests_per_window)
    arr = np.asarray(windows, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[1] != 2 or len(arr[arr[:, 1] > 0]) < 2:
        raise ValueError("windows must be at least 2 (accepted, draft tokens) pairs with draft tokens")
    arr = arr[arr[:, 1] > 0]
    return PromptAcceptance.of(arr[:, 0], arr[:, 1])


def _shifted(values: PromptAcceptance, shift: np.ndarray) -> PromptAcceptance:
    """Each window's acceptance moved by `shift` (its accepted tokens, kept within [0, draft tokens])."""
    return PromptAcceptance.of(np.clip(values.acc + shift * values.n, 0.0, values.n), values.n)


def simulate_window_checks(
    n_baseline: int,
    n_recent: int,
    level: float,
    margin: float,
    drops: Sequence[float] = (0.02, 0.05, 0.10),
    n_checks: int = 200,
    windows: Sequence[tuple[float, float]] | None = None,
    model: BetaBinomialTraffic = TRAFFIC,
    requests_per_window: int = 100,
    pool_size: int = 500,
    seed: int = 0,
    window_sd: float = 0.0,
    daily_amplitude: float = 0.0,
    window_hours: float = 1.0,
) -> WindowSimulationResult:
    """False-alarm rate (no change) and power (each drop) of `window_drop_test` as the check runs it (module
    docstring)."""
    if n_checks < 1:
        raise ValueError("n_checks must be >= 1")
    rng = np.random.default_rng(seed)
    pool = _pool(windows, rng, pool_size, model, requests_per_window)

    def cycle(first_hour: float, k: int) -> np.ndarray:
        hours = first_hour + window_hours * np.arange(k)
        return daily_amplitude * np.sin(2 * np.pi * hours / 24.0)

    def alarm(drop: float, i: int) -> bool:
        base, recent = rng.integers(0, len(pool), size=n_baseline), rng.integers(0, len(pool), size=n_recent)
        shift_base = rng.normal(0.0, window_sd, n_baseline) + cycle(rng.uniform(0, 24), n_baseline)
        shift_now = rng.normal(0.0, window_sd, n_recent) + cycle(rng.uniform(0, 24), n_recent)
        before = _shifted(PromptAcceptance.of(pool.acc[base], pool.n[base]), shift_base)
        now = thin(rng, _shifted(PromptAcceptance.of(pool.acc[recent], pool.n[recent]), shift_now), drop)
        return window_drop_test(before.acc, before.n, now.acc, now.n, margin, level, seed=seed + i).alarm

    null_alarms = sum(alarm(0.0, i) for i in range(n_checks))
    power = {float(d): sum(alarm(d, i) for i in range(n_checks)) / n_checks for d in drops}
    ci = sps.binomtest(null_alarms, n_checks).proportion_ci(0.95, method="wilson")
    return WindowSimulationResult(n_baseline, n_recent, n_checks, level, margin,
                                  "windows" if windows is not None else "beta-binomial", null_alarms / n_checks,
                                  (float(ci.low), float(ci.high)), power,
                                  None if windows is not None else requests_per_window, window_sd, daily_amplitude,
                                  window_hours)

"""How strong the canary's test is: the rate at which it fails a canary whose acceptance is `drop` below the other
replicas', at the configured number of windows, by simulation.

The same simulation as the fleet's replica-parting test (tests/monitor/fleet/test_verdicts.py): each replica's windows
are sums of beta-binomial requests (monitor.stats.window_simulation.synthetic_windows; heterogeneous prompts,
correlated tokens within one), the canary's accepted tokens lowered by `drop` of its draft tokens, and the test run
as the canary runs it (monitor.fleet.verdicts.outlier_tests, the canary against each other replica, Bonferroni over
the replicas; failed when the canary is named and lower). With `drop` 0 the rate is the test's false failures.
"""
from __future__ import annotations

import numpy as np

from monitor.fleet.counters import SpecCounters
from monitor.fleet.verdicts import outlier_tests
from monitor.fleet.window_store import ReplicaWindows, Window
from monitor.stats.false_alarms import BetaBinomialTraffic
from monitor.stats.window_simulation import synthetic_windows

CANARY = "canary"
DRAFTED_PER_REQUEST = 80.0  # the synthetic traffic's mean draft tokens a request (32..128, uniform)


def _windows(rng: np.random.Generator, k: int, requests: int, drop: float) -> list[Window]:
    w = synthetic_windows(rng, k, BetaBinomialTraffic(), requests_per_window=requests)
    acc = np.clip(w.acc - drop * w.n, 0, None)
    return [Window(f"t{i}", f"t{i + 1}", "", SpecCounters("vllm", n / 5, float(n), float(a)))
            for i, (a, n) in enumerate(zip(acc, w.n))]


def canary_fails(windows: dict[str, ReplicaWindows], level: float) -> bool:
    """Whether the canary's test fails the canary (named `CANARY` in `windows`)."""
    test = outlier_tests(windows, level).get(CANARY)
    return test is not None and test.named and test.acceptance < test.rest_acceptance


def canary_power(n_windows: int, n_others: int, level: float, drops: tuple[float, ...] = (0.0, 0.05, 0.10),
                 requests_per_window: int = 20, n_sims: int = 200, seed: int = 0) -> dict[float, float]:
    """{drop: the share of `n_sims` simulated canaries failed} for a canary against `n_others` replicas over
    `n_windows` windows of `requests_per_window` requests each (module docstring)."""
    rng = np.random.default_rng(seed)
    out = {}
    for drop in drops:
        failed = 0
        for _ in range(n_sims):
            fleet = {CANARY: ReplicaWindows(CANARY, recent=_windows(rng, n_windows, requests_per_window, drop))}
            fleet.update({f"r{i}": ReplicaWindows(f"r{i}", recent=_windows(rng, n_windows, requests_per_window, 0.0))
                          for i in range(n_others)})
            failed += canary_fails(fleet, level)
        out[drop] = failed / n_sims
    return out


def requests_per_window(draft_tokens: list[float]) -> int:
    """The synthetic requests a window needs to hold as many draft tokens as the median window read (5 to 500)."""
    if not draft_tokens:
        return 20
    return int(min(max(round(float(np.median(draft_tokens)) / DRAFTED_PER_REQUEST), 5), 500))

"""What a serving engine's counters should read for a draft, from its offline measurement, and the test of whether
they read clearly less.

Engine acceptance. vLLM and llama-server count accepted / draft tokens: every round drafts k tokens and the tokens
after the first rejected one count as drafted, not accepted. That is not the offline analytic α (the acceptance of
each response token given the target's prefix), so the two are compared on the engine's terms: `engine_rounds`
replays the engine's rounds over a response's per-token α, as llama-server runs them (tools/server/server-context.cpp,
`get_n_draft_max`): the target alone gives the first token after the prompt; each round drafts
k = min(γ, max_new_tokens − decoded − 1) tokens; the run of accepted positions ends at the first rejection (a position
past the response's end, its stop token, is never accepted); the target adds one token; the response ends at its stop
token or at max_new_tokens. With α ∈ {0, 1} (greedy, temperature 0) the replay is exact; with α strictly between, it
is the expectation over rounds (one pass over start positions), under the usual assumption that each position is
accepted with its teacher-forced α."""
# The test. The offline side is per prompt (acc_i, n_i), the engine side per window between two scrapes (acc_j, n_j):
# two independent samples of different units, each a ratio estimator. The tolerance is relative: H0 is "the engine
# keeps at least (1 − tolerance) of the offline figure", A_engine ≥ (1 − t)·A_offline, since an engine's own precision
# costs a draft that is almost always accepted more than one that rarely is (a flipped near-tie ends a whole round).
# The statistic (1 − t)·A_offline − A_engine has the sum of each side's linearized variance (the delta method of
# `monitor.stats.acceptance_tests`); with only a few engine windows, the one-sided p-value and interval
# use Student's t with Welch–Satterthwaite degrees of freedom instead of the normal. The DropTest reports drop =
# A_offline − A_engine with margin t·A_offline. `tests/monitor/check/test_deploy_hooks.py` simulates its false-alarm
# rate
# at the level.
#
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy import stats

from monitor.stats.acceptance_tests import DropTest

ENGINE_VS_OFFLINE = "engine_vs_offline_welch"


def engine_rounds(alphas: Sequence[float], gamma: int, max_new_tokens: int) -> tuple[float, float]:
    """(accepted, drafted) draft tokens an engine counts for one response whose token t is accepted with probability
    alphas[t], drafting up to `gamma` tokens a round and stopping at `max_new_tokens` (module docstring)."""
    length = len(alphas)
    if gamma < 1 or length < 2:
        return 0.0, 0.0
    reach = np.zeros(length + 1)  # probability that a round starts with `decoded` tokens known
    reach[1] = 1.0
    accepted = drafted = 0.0
    for decoded in range(1, length):
        p = reach[decoded]
        if p == 0.0:
            continue
        k = min(gamma, max_new_tokens - decoded - 1)
        if k <= 0:  # no room to draft: the target's own step
            reach[decoded + 1] += p
            continue
        drafted += p * k
        survive = 1.0
        for run in range(k + 1):
            position = decoded + run
            if run == k:
                stop = survive
            else:
                alpha = alphas[position] if position < length else 0.0
                stop, survive = survive * (1.0 - alpha), survive * alpha
            accepted += p * run * stop
            reach[min(decoded + run + 1, length)] += p * stop
            if survive == 0.0 and run < k:
                break
    return accepted, drafted


def _linearized(acc: np.ndarray, n: np.ndarray) -> tuple[float, np.ndarray]:
    ratio = float(acc.sum() / n.sum())
    return ratio, (acc - ratio * n) / n.mean()


def engine_vs_offline_test(offline_acc: Sequence[float], offline_n: Sequence[float], window_acc: Sequence[float],
                           window_n: Sequence[float], tolerance: float, level: float) -> DropTest:
    """One-sided test of H0: A_engine >= (1 − tolerance)·A_offline (module docstring): `alarm` when the engine's
    windows read clearly less than the offline prompts measured. The DropTest's baseline is the offline side (its
    prompts), the current one the engine (its windows), its margin tolerance·A_offline."""
    acc0, n0 = np.asarray(offline_acc, dtype=np.float64), np.asarray(offline_n, dtype=np.float64)
    acc1, n1 = np.asarray(window_acc, dtype=np.float64), np.asarray(window_n, dtype=np.float64)
    if acc0.size < 2 or acc1.size < 2:
        raise ValueError(f"engine check: need at least 2 offline prompts and 2 engine windows, got {acc0.size} and "
                         f"{acc1.size}")
    if n0.sum() <= 0 or n1.sum() <= 0:
        raise ValueError("engine check: no draft tokens on one side")
    keep = 1.0 - tolerance
    a0, u0 = _linearized(acc0, n0)
    a1, u1 = _linearized(acc1, n1)
    drop, margin = a0 - a1, tolerance * a0
    v0, v1 = keep ** 2 * u0.var(ddof=1) / u0.size, u1.var(ddof=1) / u1.size
    se = float(np.sqrt(v0 + v1))
    if se <= 0.0:
        p_value, low, high = (0.0 if drop > margin else 1.0), drop, drop
    else:
        df = (v0 + v1) ** 2 / (v0 ** 2 / (u0.size - 1) + v1 ** 2 / (u1.size - 1))
        p_value = float(stats.t.sf((drop - margin) / se, df))
        half = float(stats.t.ppf(1.0 - level, df)) * se
        low, high = drop - half, drop + half
    return DropTest(ENGINE_VS_OFFLINE, a0, a1, drop, float(low), float(high), p_value, p_value < level, margin, level,
                    int(acc0.size), int(acc1.size))

"""decode.bench's cost accounting and its denominator, on hand-made timings."""
from __future__ import annotations

import pytest

from decode.bench import TARGET_ONLY, TARGET_ONLY_TORCH, in_run_costs, method_results
from decode.stats import GenerationStats


def test_in_run_costs_split_the_decoders_time_into_model_calls_and_bookkeeping():
    # plain decoding: 100 tokens in 4 s -> 40 ms a token
    target_only = {"seconds": 4.0, "new_tokens": 100}
    a = GenerationStats(new_tokens=60, target_calls=30, draft_calls=120, prefill_s=0.1, draft_s=0.6, verify_s=1.5,
                        total_s=2.4)
    b = GenerationStats(new_tokens=40, target_calls=20, draft_calls=80, prefill_s=0.1, draft_s=0.4, verify_s=1.0,
                        total_s=1.6)
    costs = in_run_costs([a, b], target_only)
    assert costs["target_step_s"] == pytest.approx(0.04)
    assert costs["c"] == pytest.approx((1.0 / 200) / 0.04)  # 5 ms a draft call
    assert costs["v"] == pytest.approx((2.5 / 50) / 0.04)  # 50 ms a verify
    assert costs["drafts_per_round"] == pytest.approx(4.0)
    assert costs["overhead_free_bound"] == pytest.approx(4.0 / 3.7)  # model time 0.2 + 1.0 + 2.5
    assert costs["model_time_share"] == pytest.approx(3.7 / 4.0)


def bench_rows(seconds_per_token: dict[str, float]) -> tuple[dict, dict]:
    """Two prompts of 10 and 30 new tokens, each method at its hand-made seconds per token; all outputs alike."""
    outputs = {name: [[1] * 10, [2] * 30] for name in seconds_per_token}
    seconds = {name: [10 * s, 30 * s] for name, s in seconds_per_token.items()}
    return outputs, seconds


def test_speedups_are_against_the_faster_target_only_row():
    # the target on torch's stock kernels (40 ms a token) beats it on draftops' kernels (50 ms a token)
    outputs, seconds = bench_rows({TARGET_ONLY: 0.05, TARGET_ONLY_TORCH: 0.04, "speculative": 0.02})
    results, baseline = method_results(outputs, seconds, seed=0)
    assert baseline == TARGET_ONLY_TORCH and "speedup" not in results[TARGET_ONLY_TORCH]
    assert results["speculative"]["speedup"]["value"] == pytest.approx(2.0)  # 0.04 / 0.02, not 0.05 / 0.02
    assert results[TARGET_ONLY]["speedup"]["value"] == pytest.approx(0.8)
    assert results[TARGET_ONLY]["tokens_per_s"]["value"] == pytest.approx(20.0)
    assert all(r["same_output_as_target"] == 2 and r["new_tokens"] == 40 for r in results.values())

    outputs, seconds = bench_rows({TARGET_ONLY: 0.03, TARGET_ONLY_TORCH: 0.04, "speculative": 0.02})
    results, baseline = method_results(outputs, seconds, seed=0)
    assert baseline == TARGET_ONLY and results["speculative"]["speedup"]["value"] == pytest.approx(1.5)
    assert results[TARGET_ONLY_TORCH]["speedup"]["value"] == pytest.approx(0.75)

    outputs, seconds = bench_rows({TARGET_ONLY: 0.05, "speculative": 0.02})  # kernels already torch's: one row
    assert method_results(outputs, seconds, seed=0)[1] == TARGET_ONLY

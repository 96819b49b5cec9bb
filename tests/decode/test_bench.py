"""decode.bench's cost accounting, on hand-made timings."""
from __future__ import annotations

import pytest

from decode.bench import in_run_costs
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

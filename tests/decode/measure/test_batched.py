"""decode.measure.batched: a batch decoded greedily, with and without a draft, gives every sequence its own greedy
output."""
from __future__ import annotations

import pytest
import torch

from decode.measure.batched import batched_greedy, batched_speculative
from decode.runtime.lean import LeanDecoder
from tests.decode.tiny import greedy_reference

PROMPTS = [[5, 9, 2, 77, 3, 8, 1], [3, 3, 8, 8, 3, 3, 8], [100, 4, 17, 17, 60, 2, 9]]


@torch.inference_mode()
def test_ragged_rows_each_see_their_own_slots(target):
    lean = LeanDecoder(target)
    tokens = torch.tensor(PROMPTS)
    cache = lean.new_cache(3)
    lean.forward_batch(tokens[:, :4], cache, 0, False)
    # row 0 goes on from slot 4, row 1 from slot 2 (its slots 2-3 are stale and rewritten), row 2 from slot 3
    starts = torch.tensor([4, 2, 3])
    got = lean.forward_ragged(torch.stack([tokens[b, s : s + 3] for b, s in enumerate(starts.tolist())]), cache,
                              starts)
    for b, start in enumerate(starts.tolist()):
        alone = lean.new_cache()
        want = lean.forward_logits(tokens[b, : start + 3], alone, 0, False)[start:]
        torch.testing.assert_close(got[b], want, rtol=1e-10, atol=1e-10)


def test_a_grown_cache_holds_zeros_where_nothing_was_written(target):
    """A ragged row ends before the batch's last slot; its unwritten slots are masked, but their values still enter
    attention as 0 × value, so they must be numbers (fresh memory could hold NaN)."""
    cache = LeanDecoder(target).new_cache(2)
    cache.reserve(300)
    assert cache.keys[0].shape[2] >= 300
    assert all(bool((entry == 0).all()) for entry in cache.keys + cache.values)


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_batched_speculation_gives_each_sequence_its_greedy_output(target, close_draft, random_draft, gamma):
    want = [greedy_reference(target, p, 12) for p in PROMPTS]
    outputs, stats = batched_greedy(target, PROMPTS, 12)
    assert outputs == want and stats["decode_s"] > 0
    outputs, stats = batched_speculative(target, close_draft, PROMPTS, 12, gamma)
    assert outputs == want and stats["drafted"] == 3 * gamma * stats["rounds"] and stats["decode_s"] > 0
    assert 0 < stats["accepted"] <= stats["drafted"]  # a close draft is accepted, and rows go on at their own pace
    assert batched_speculative(target, random_draft, PROMPTS, 12, gamma)[0] == want


def test_a_reduced_vocabulary_draft_proposes_target_ids(target, reduced_draft):
    draft, token_ids = reduced_draft
    outputs, _ = batched_speculative(target, draft, PROMPTS[:2], 9, 3, draft_token_ids=token_ids)
    assert outputs == [greedy_reference(target, p, 9) for p in PROMPTS[:2]]
    with pytest.raises(ValueError, match="prompts of one length, at least 3 tokens"):
        batched_speculative(target, draft, [[1, 2, 3], [1, 2]], 4, 2)

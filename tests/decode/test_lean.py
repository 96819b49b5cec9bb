"""decode.lean.LeanLlama against its reference, the transformers forward with a DynamicCache."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from decode.lean import LeanLlama
from decode.runtime import forward_logits, rollback
from decode.speculative import SpeculativeDecoder
from tests.decode.tiny import greedy_reference, tiny_llama


@pytest.mark.parametrize("draft_vocab", [None, 40])
@torch.inference_mode()
def test_same_logits_as_the_transformers_forward_through_blocks_and_rollbacks(draft_vocab):
    model = tiny_llama(5, draft_vocab=draft_vocab)
    lean = LeanLlama(model)
    assert LeanLlama.supports(model)
    tokens = torch.randint(0, 128, (300,), generator=torch.Generator().manual_seed(0))
    ref_cache, cache = DynamicCache(config=model.config), lean.new_cache()
    position = 0
    # a prefill, single steps, verify-sized blocks, rollbacks, and growth past the first capacity (256)
    for n, keep_last, back in [(40, True, 0), (1, True, 0), (5, False, 2), (1, True, 0), (3, False, 3), (230, False, 0),
                               (6, False, 1)]:
        block = tokens[position:position + n]
        expected = forward_logits(model, block, ref_cache, position, keep_last)
        got = lean.forward_logits(block, cache, position, keep_last)
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
        position += n - back
        rollback(ref_cache, position)
        rollback(cache, position)
        assert cache.get_seq_length() == ref_cache.get_seq_length() == position


def test_decoder_output_is_the_same_with_and_without_it(target, close_draft):
    prompt = [5, 9, 2, 77, 3]
    lean = SpeculativeDecoder(target, close_draft, 4)
    plain = SpeculativeDecoder(target, close_draft, 4, lean=False)
    assert lean.drafter.runner.lean is not None and lean.target_runner.lean is not None
    assert plain.drafter.runner.lean is None and plain.target_runner.lean is None
    a, b = lean.generate(prompt, max_new_tokens=40), plain.generate(prompt, max_new_tokens=40)
    assert a.token_ids == b.token_ids == greedy_reference(target, prompt, 40)
    assert (a.stats.accepted, a.stats.draft_calls) == (b.stats.accepted, b.stats.draft_calls)
    for seed in range(3):
        assert (lean.generate(prompt, max_new_tokens=20, temperature=1.0, seed=seed).token_ids
                == plain.generate(prompt, max_new_tokens=20, temperature=1.0, seed=seed).token_ids)


def test_other_architectures_and_training_mode_keep_the_transformers_forward():
    model = tiny_llama(6)
    model.train()
    assert not LeanLlama.supports(model)
    model.config.model_type = "gpt2"
    assert not LeanLlama.supports(model.eval())

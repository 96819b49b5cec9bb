"""decode.lean.LeanLlama against its reference, the transformers forward with a DynamicCache."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import DynamicCache

from decode.lean import LeanLlama
from decode.runtime import ModelRunner, forward_logits, greedy_decode, rollback
from decode.speculative import SpeculativeDecoder
from tests.decode.tiny import greedy_reference, tiny_llama


@pytest.mark.parametrize("draft_vocab,compiled", [(None, False), (40, False), (None, True)],
                         ids=["eager", "reduced-head", "compiled"])
@torch.inference_mode()
def test_same_logits_as_the_transformers_forward_through_blocks_and_rollbacks(draft_vocab, compiled):
    model = tiny_llama(5, draft_vocab=draft_vocab)
    lean = LeanLlama(model, compiled=compiled)
    assert LeanLlama.supports(model)
    tokens = torch.randint(0, 128, (300,), generator=torch.Generator().manual_seed(0))
    ref_cache, cache = DynamicCache(config=model.config), lean.new_cache()
    position = 0
    # compiled: inductor's kernels move these float64 logits by up to ~1.3e-5 (measured), and the argmax must agree;
    # eager: the same function to rounding
    tolerance = 1e-4 if compiled else 1e-10
    # a prefill, single steps, verify-sized blocks, rollbacks, and growth past the first capacity (256)
    for n, keep_last, back in [(40, True, 0), (1, True, 0), (5, False, 2), (1, True, 0), (3, False, 3), (230, False, 0),
                               (6, False, 1)]:
        block = tokens[position:position + n]
        expected = forward_logits(model, block, ref_cache, position, keep_last)
        got = lean.forward_logits(block, cache, position, keep_last)
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
        position += n - back
        rollback(ref_cache, position)
        rollback(cache, position)
        assert cache.get_seq_length() == ref_cache.get_seq_length() == position


@torch.inference_mode()
def test_a_batch_gives_each_sequences_own_logits():
    model = tiny_llama(5)
    lean = LeanLlama(model)
    tokens = torch.randint(0, 128, (3, 30), generator=torch.Generator().manual_seed(1))
    alone = []
    for row in tokens:  # each sequence on its own: a prefill of 24 tokens, a step, then a 5-token verify block
        cache = lean.new_cache()
        lean.forward_logits(row[:24], cache, 0, True)
        step = lean.forward_logits(row[24:25], cache, 24, True)
        alone.append((step, lean.forward_logits(row[25:30], cache, 25, False)))
    cache = lean.new_cache(batch=3)
    lean.forward_batch(tokens[:, :24], cache, 0, True)
    step = lean.forward_batch(tokens[:, 24:25], cache, 24, True)
    block = lean.forward_batch(tokens[:, 25:30], cache, 25, False)
    assert step.shape == (3, 1, 128) and block.shape == (3, 5, 128)
    for i, (step_alone, block_alone) in enumerate(alone):
        torch.testing.assert_close(step[i], step_alone, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(block[i], block_alone, rtol=1e-5, atol=1e-5)
    # a cache repeated from one sequence's continues as that sequence does in every row
    single = lean.new_cache()
    lean.forward_logits(tokens[0, :24], single, 0, True)
    repeated = single.repeated(4)
    assert repeated.keys[0].shape[0] == 4 and repeated.get_seq_length() == 24
    rows = lean.forward_batch(tokens[0, 24:30].repeat(4, 1), repeated, 24, False)
    for row in rows:
        torch.testing.assert_close(row[1:], alone[0][1], rtol=1e-5, atol=1e-5)


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


@torch.inference_mode()
def test_the_compiled_forward_builds_one_graph_for_prefills_and_one_for_steps_whatever_the_length():
    """Compiling takes minutes on the real target: prompts of other lengths and a cache that grows past its capacity
    (or fills it exactly) must not build new graphs in the middle of decoding."""
    torch._dynamo.reset()
    counters.clear()
    runner = ModelRunner(tiny_llama(2), compiled=True)
    for length in (7, 250, 255, 600):  # 255 + 1 fills the first capacity (256) exactly
        greedy_decode(runner, [1 + i % 100 for i in range(length)], 3, [])
    assert counters["stats"]["unique_graphs"] == 2

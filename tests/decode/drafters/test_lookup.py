"""Prompt lookup drafting: what it proposes, and that decoding with it is lossless (greedy and sampled)."""

import pytest
import torch

from decode.drafters.lookup import PromptLookupDrafter
from decode.factory import model_decoder
from decode.sampling import Warp
from decode.speculative import GammaPolicy
from tests.decode.tiny import greedy_reference, tiny_llama
from tests.lossless.test_drafts_and_families import check_first_two


def test_lookup_proposes_the_continuation_of_the_latest_longest_match():
    drafter = PromptLookupDrafter(100, max_ngram=3)
    #      0  1  2  3  4  5  6  7  8  9  10
    seq = [7, 1, 2, 3, 9, 1, 2, 4, 5, 1, 2]
    assert drafter.lookup(seq, 2) == [4, 5]  # "1 2" last occurred at 5..6 (the 3-gram "5 1 2" never did)
    assert drafter.lookup(seq + [4], 5) == [5, 1, 2, 4]  # "1 2 4" at 5..7: what followed, up to the end
    assert drafter.lookup([1, 2, 3], 4) == []  # no earlier occurrence of 3
    assert drafter.lookup([5], 4) == [] and drafter.lookup(seq, 0) == []
    assert PromptLookupDrafter(100, max_ngram=2, min_ngram=2).lookup([1, 2, 3, 2], 2) == []  # 1-grams not allowed
    drafts, q, forwards = drafter.propose(None, seq, 2, Warp(temperature=1.0), None)
    assert drafts.tolist() == [4, 5] and forwards == 0
    assert torch.equal(q, torch.nn.functional.one_hot(torch.tensor([4, 5]), 100).float())
    drafts, q, _ = drafter.propose(None, seq, 2, Warp(), None)
    assert drafts.tolist() == [4, 5] and q is None  # greedy: the test reads the tokens only
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupDrafter(100, max_ngram=1, min_ngram=2)


def repetitive_prompt(seed: int) -> list[int]:
    torch.manual_seed(seed)
    phrase = torch.randint(0, 128, (5,)).tolist()
    return phrase + torch.randint(0, 128, (3,)).tolist() + phrase


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_greedy_equals_target_only_greedy(target, gamma):
    drafter = PromptLookupDrafter.for_model(target)
    decoder = model_decoder(target, drafter, gamma)
    accepted = 0
    for seed in range(4):
        prompt = repetitive_prompt(seed)
        result = decoder.generate(prompt, max_new_tokens=30)
        assert result.token_ids == greedy_reference(target, prompt, 30)
        stats = result.stats
        assert stats.draft_calls == 0 and stats.accepted <= stats.verified <= stats.drafted
        accepted += stats.accepted
    assert accepted > 0  # lookups were taken, not only plain target steps


def test_gamma_schedule_with_lookup_stays_lossless(target):
    prompt = repetitive_prompt(0)
    decoder = model_decoder(target, PromptLookupDrafter.for_model(target),
                                 GammaPolicy.scheduled([(20, 1), (40, 4)]))
    result = decoder.generate(prompt, max_new_tokens=30)
    assert result.token_ids == greedy_reference(target, prompt, 30)
    assert len(result.stats.drafted_at) <= 4


VOCAB = 16
PROMPT = [3, 5, 3, 5, 3]  # the first block proposes "5 3": both draft positions and the bonus token are exercised


def test_lossless_when_sampling():
    target = tiny_llama(10, vocab_size=VOCAB, init_range=0.15)
    stats = check_first_two(target, model_decoder(target, PromptLookupDrafter.for_model(target), 2), PROMPT)
    assert 0 < sum(s.accepted for s in stats) < sum(s.verified for s in stats)  # acceptances and rejections


def test_lookup_then_model_is_lossless_and_uses_both(target, close_draft):
    decoder = model_decoder(target, close_draft, 3, lookup_min_ngram=2)
    model_calls = lookup_accepted = 0
    for seed in range(4):
        prompt = repetitive_prompt(seed)
        result = decoder.generate(prompt, max_new_tokens=30)
        assert result.token_ids == greedy_reference(target, prompt, 30)
        model_calls += result.stats.draft_calls
        lookup_accepted += result.stats.accepted
    assert model_calls > 0 and lookup_accepted > 0
    with pytest.raises(ValueError, match="apply to draft models only"):
        model_decoder(target, PromptLookupDrafter.for_model(target), 2, lookup_min_ngram=2)


def test_lookup_then_model_is_lossless_when_sampling():
    target = tiny_llama(10, vocab_size=VOCAB, init_range=0.15)
    draft = tiny_llama(11, vocab_size=VOCAB, init_range=0.15)
    # "7" never occurred before: the first block is the model's; the second may be a lookup
    check_first_two(target, model_decoder(target, draft, 2, lookup_min_ngram=1), PROMPT + [7])

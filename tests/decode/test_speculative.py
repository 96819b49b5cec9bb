import pytest
import torch

from decode.factory import model_decoder
from decode.sampling import confident
from decode.speculative import GammaPolicy
from tests.decode.tiny import greedy_reference, tiny_llama, word_tokenizer


def random_prompt(seed: int, length: int = 6, vocab_size: int = 128) -> list[int]:
    return torch.randint(0, vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def references(target):
    return {seed: greedy_reference(target, random_prompt(seed), 24) for seed in (0, 1, 2)}


@pytest.mark.parametrize("gamma", [1, 3, 5])
@pytest.mark.parametrize("draft_name", ["random_draft", "close_draft", "target", "reduced_draft"])
def test_greedy_equals_target_only_greedy(request, target, references, draft_name, gamma):
    draft, token_ids = request.getfixturevalue(draft_name), None
    if draft_name == "reduced_draft":
        draft, token_ids = draft
    decoder = model_decoder(target, draft, gamma, draft_token_ids=token_ids)
    for seed, expected in references.items():
        result = decoder.generate(random_prompt(seed), max_new_tokens=24)
        assert result.token_ids == expected
        stats = result.stats
        assert stats.new_tokens == 24 and stats.stop_reason == "max_new_tokens"
        assert stats.accepted <= stats.verified <= stats.drafted
        assert stats.tau == 24 / stats.target_calls
        assert stats.draft_calls == stats.drafted
        if draft_name == "target":  # every draft accepted: γ+1 tokens per target call
            assert stats.accepted == stats.drafted and stats.acceptance_rate == 1.0
            assert stats.target_calls == -(-24 // (gamma + 1))


def test_identical_draft_accepts_everything_when_sampling(target):
    stats = model_decoder(target, target, 4).generate([3, 1, 4], max_new_tokens=60, temperature=1.0, seed=0).stats
    assert stats.acceptance_rate >= 0.99  # p and q differ only by rounding between cached passes
    assert stats.tau >= 4.5


def test_adaptive_gamma_stays_lossless_and_grows(target, close_draft, references):
    policy = GammaPolicy("adaptive", 2, max_gamma=8)
    decoder = model_decoder(target, close_draft, policy, draft_min_confidence=0.3)
    for seed, expected in references.items():
        assert decoder.generate(random_prompt(seed), max_new_tokens=24).token_ids == expected
    stats = model_decoder(target, target, policy).generate([5], max_new_tokens=40).stats
    assert len(stats.drafted_at) > 2  # γ grew while everything was accepted
    assert policy.next(8, 0, 8, 8) == 8 and policy.next(1, 0, 1, 0) == 1 and policy.next(4, 0, 4, 4) == 6
    assert policy.next(4, 0, 4, 2) == 3


def test_gamma_policy_validates_its_settings():
    assert GammaPolicy().first(100) == 5 and GammaPolicy().next(5, 100, 5, 0) == 5
    with pytest.raises(ValueError, match="gamma must be >= 1"):
        GammaPolicy("fixed", 0)
    with pytest.raises(ValueError, match="needs the 'schedule' policy"):
        GammaPolicy("adaptive", 2, schedule=((10, 2),))
    with pytest.raises(ValueError, match="fixed, schedule or adaptive"):
        GammaPolicy("heuristic")


def test_eos_defaults_to_the_targets_generation_config(target, close_draft):
    prompt = random_prompt(0)
    reference = greedy_reference(target, prompt, 24)
    target.generation_config.eos_token_id = reference[3]
    try:
        result = model_decoder(target, close_draft, 3).generate(prompt, max_new_tokens=24)
        assert result.token_ids == reference[: reference.index(reference[3]) + 1]
        assert result.stats.stop_reason == "eos"
        assert len(model_decoder(target, close_draft, 3, eos_token_ids=()).generate(
            prompt, max_new_tokens=24).token_ids) == 24
    finally:
        target.generation_config.eos_token_id = None


def test_sampling_is_reproducible_with_seed(target, close_draft):
    decoder = model_decoder(target, close_draft, 3)
    first = decoder.generate([1, 2, 3], max_new_tokens=20, temperature=0.8, top_p=0.9, seed=7).token_ids
    assert decoder.generate([1, 2, 3], max_new_tokens=20, temperature=0.8, top_p=0.9, seed=7).token_ids == first
    assert decoder.generate([1, 2, 3], max_new_tokens=20, temperature=0.8, top_p=0.9, seed=8).token_ids != first


def test_gamma_one(target, close_draft, references):
    result = model_decoder(target, close_draft, 1).generate(random_prompt(1), max_new_tokens=24)
    assert result.token_ids == references[1]
    assert len(result.stats.drafted_at) == 1 and result.stats.drafted == result.stats.target_calls - 1


@pytest.mark.parametrize("max_new_tokens", [1, 2, 4, 5, 6, 7, 11])
def test_max_new_tokens_inside_a_block(target, references, max_new_tokens):
    result = model_decoder(target, target, 5).generate(random_prompt(0), max_new_tokens=max_new_tokens)
    assert result.token_ids == references[0][:max_new_tokens]
    assert result.stats.target_calls == -(-max_new_tokens // 6)


def test_eos_inside_a_draft_block(target, references):
    expected = references[2]
    # the first position >= 2 holding a token that did not occur before: EOS lands mid-block for γ=5
    stop = next(i for i in range(2, len(expected)) if expected[i] not in expected[:i])
    result = model_decoder(target, target, 5, eos_token_ids=[expected[stop]]).generate(
        random_prompt(2), max_new_tokens=24
    )
    assert result.token_ids == expected[: stop + 1]
    assert result.stats.stop_reason == "eos" and result.stats.new_tokens == stop + 1
    assert model_decoder(target, target, 5, eos_token_ids=expected[stop]).generate(
        random_prompt(2), max_new_tokens=24
    ).token_ids == expected[: stop + 1]


def test_stop_string_inside_a_block(target, references):
    tokenizer = word_tokenizer(128)
    expected = references[0]
    stop_string = tokenizer.decode(expected[5:7])  # two words; may also occur earlier
    cut = next(n for n in range(1, 25) if stop_string in tokenizer.decode(expected[:n]))
    decoder = model_decoder(target, target, 5, stop_strings=[stop_string, "never-produced"], tokenizer=tokenizer)
    result = decoder.generate(random_prompt(0), max_new_tokens=24)
    assert result.token_ids == expected[:cut] and result.stats.stop_reason == "stop_string"


def test_context_limit():
    model = tiny_llama(5, context=16)
    prompt = random_prompt(3, length=15)
    expected = greedy_reference(model, prompt, 1)
    result = model_decoder(model, model, 4).generate(prompt, max_new_tokens=10)
    assert result.token_ids == expected and result.stats.stop_reason == "context"
    result = model_decoder(model, model, 4).generate(prompt[:9], max_new_tokens=100)
    assert result.token_ids == greedy_reference(model, prompt[:9], 7)  # stops at 16 tokens in all
    with pytest.raises(ValueError, match=r"prompt has 16 tokens but the model context is 16"):
        model_decoder(model, model, 4).generate(prompt + [1], max_new_tokens=1)


def test_clear_errors(target, random_draft, reduced_draft):
    with pytest.raises(ValueError, match="gamma must be >= 1"):
        model_decoder(target, random_draft, 0)
    with pytest.raises(ValueError, match="empty prompt"):
        model_decoder(target, random_draft, 2).generate([], max_new_tokens=3)
    with pytest.raises(ValueError, match="batch size 1"):
        model_decoder(target, random_draft, 2).generate(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="vocab mismatch: draft embeds 100 token ids but the target emits 128"):
        model_decoder(target, tiny_llama(4, vocab_size=100), 2)
    with pytest.raises(ValueError, match="vocab mismatch: draft predicts 200 tokens, target 128"):
        model_decoder(target, tiny_llama(4, vocab_size=200), 2)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0"):
        model_decoder(target, random_draft, 2).generate([1], max_new_tokens=-1)
    assert model_decoder(target, random_draft, 2).generate([1], max_new_tokens=0).token_ids == []
    draft, token_ids = reduced_draft
    with pytest.raises(ValueError, match="vocab mismatch: draft predicts 64 tokens, target 128"):
        model_decoder(target, draft, 2)
    with pytest.raises(ValueError, match="draft_token_ids has 63 entries"):
        model_decoder(target, draft, 2, draft_token_ids=token_ids[:-1])
    with pytest.raises(ValueError, match="sorted, unique"):
        model_decoder(target, draft, 2, draft_token_ids=token_ids.flip(0))
    with pytest.raises(ValueError, match="stop_strings need a tokenizer"):
        model_decoder(target, target, 2, stop_strings=["x"])


def test_timings_split_prefill_drafting_and_verifying(target, close_draft, monkeypatch):
    """On a clock that only the models move (a target pass costs 10, a proposal 1): each phase gets its own time."""
    clock = [0.0]
    monkeypatch.setattr("decode.generation_stats.time.perf_counter", lambda: clock[0])
    decoder = model_decoder(target, close_draft, 3)
    forward, propose = decoder.target_runner.forward, decoder.drafter.propose

    def target_pass(*args, **kwargs):
        clock[0] += 10.0
        return forward(*args, **kwargs)

    def proposal(*args, **kwargs):
        clock[0] += 1.0
        return propose(*args, **kwargs)

    monkeypatch.setattr(decoder.target_runner, "forward", target_pass)
    monkeypatch.setattr(decoder.drafter, "propose", proposal)
    stats = decoder.generate([1, 2, 3, 4], max_new_tokens=12).stats
    rounds = stats.target_calls
    assert stats.prefill_s == 10.0  # the target's prompt pass; the draft's own prefill costs no clock here
    assert stats.draft_s == 1.0 * rounds and stats.verify_s == 10.0 * rounds
    assert stats.total_s == 10.0 + 11.0 * rounds and stats.overhead_s == 0.0
    assert stats.tokens_per_s == 12 / stats.total_s


def test_greedy_verify_matches_the_general_test_on_one_hot_distributions():
    from decode.sampling import warp_logits
    from decode.speculative import verify, verify_greedy

    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        logits = torch.randn(5, 40, generator=generator)
        p = warp_logits(logits, 0.0)
        targets = logits.argmax(-1)
        drafts = torch.where(torch.rand(4, generator=generator) < 0.6, targets[:4], (targets[:4] + 1) % 40)
        q = torch.nn.functional.one_hot(drafts, 40).float()
        accepted, next_tokens = verify(p, q, drafts, generator)
        fast_accepted, fast_next = verify_greedy(p, drafts)
        assert torch.equal(accepted, fast_accepted) and torch.equal(next_tokens, fast_next)


def test_confident_reads_the_top_probability():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    assert confident(logits, 0.5) and not confident(logits, 0.51)


def test_min_confidence_alone_ends_blocks_and_stays_lossless(target, random_draft, references):
    decoder = model_decoder(target, random_draft, 6, draft_min_confidence=1.01)
    assert decoder.gamma == GammaPolicy("fixed", 6)
    result = decoder.generate(random_prompt(0), max_new_tokens=24)
    assert result.token_ids == references[0]
    assert len(result.stats.drafted_at) == 1 and result.stats.draft_calls > result.stats.drafted

import copy

import pytest
import torch
from scipy.stats import chisquare
from transformers import GPT2Config, GPT2LMHeadModel

from decode.runtime.batch_generation import Job, generate
from decode.runtime.lean import LeanDecoder, attention_dtype
from tests.decode.tiny import greedy_reference, tiny_llama

PROMPTS = [[1, 10, 11, 12], [1, 20, 21], [1, 30, 31, 32, 33, 34], [1, 5], [1, 6, 7, 8]]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(0)


@pytest.mark.parametrize("batch_size", [1, 2, 5, 8])
def test_greedy_rows_refilled_as_they_end_equal_single_sequence_greedy(model, batch_size):
    expected = [greedy_reference(model, p, 7) for p in PROMPTS]
    out = generate(model, [Job(p) for p in PROMPTS], max_new_tokens=7, stop_ids=[], batch_size=batch_size, topk=4)
    assert [g.tokens for g in out] == expected
    for prompt, g in zip(PROMPTS, out):  # the recorded teacher is the temperature-1 top-k at every new token
        logits = model(torch.tensor([prompt + g.tokens])).logits[0, len(prompt) - 1 : -1]
        values, ids = torch.log_softmax(logits, -1).topk(4, dim=-1)
        assert g.topk_indices.dtype == torch.int32 and g.topk_logprobs.dtype == torch.float16
        assert torch.equal(g.topk_indices, ids.int())
        torch.testing.assert_close(g.topk_logprobs.float(), values.float(), atol=2e-3, rtol=0)


def test_a_job_ends_at_its_first_stop_token_and_its_row_goes_on_with_the_next(model):
    expected = [greedy_reference(model, p, 7) for p in PROMPTS]
    stop = expected[0][2]
    done = []
    out = generate(model, [Job(p) for p in PROMPTS], max_new_tokens=7, stop_ids=[stop], batch_size=2, topk=3,
                   on_done=lambda index, g: done.append(index))
    for g, tokens in zip(out, expected):
        assert g.tokens == (tokens[: tokens.index(stop) + 1] if stop in tokens else tokens)
        assert g.topk_indices.shape == (len(g.tokens), 3)
    assert sorted(done) == list(range(len(PROMPTS)))


def test_samples_do_not_depend_on_the_batch_order_or_shared_prompts(model):
    jobs = [Job(p, 0.9, seed) for seed, p in enumerate(PROMPTS)]
    runs = [generate(model, jobs, max_new_tokens=6, stop_ids=[], batch_size=b, topk=2) for b in (1, 3, 5)]
    assert all([g.tokens for g in run] == [g.tokens for g in runs[0]] for run in runs)
    reversed_run = generate(model, jobs[::-1], max_new_tokens=6, stop_ids=[], batch_size=2, topk=2, prefix_bytes=0)
    assert [g.tokens for g in reversed_run[::-1]] == [g.tokens for g in runs[0]]
    other_seeds = generate(model, [Job(j.prompt, 0.9, j.seed + 10) for j in jobs], max_new_tokens=6, stop_ids=[],
                           batch_size=5, topk=2)
    assert [g.tokens for g in other_seeds] != [g.tokens for g in runs[0]]
    # several samples of one prompt, its prefill shared, and greedy jobs beside them
    mixed = [Job(PROMPTS[0], 0.9, 0), Job(PROMPTS[0]), Job(PROMPTS[0], 0.9, 0), Job(PROMPTS[0], 0.9, 7)]
    out = generate(model, mixed, max_new_tokens=6, stop_ids=[], batch_size=2, topk=2)
    assert out[0].tokens == out[2].tokens == runs[0][0].tokens and out[3].tokens != out[0].tokens
    assert out[1].tokens == greedy_reference(model, PROMPTS[0], 6)


def test_sampled_tokens_follow_the_temperature_scaled_distribution(model):
    """First tokens of 3,000 seeds against softmax(logits / T) of the prompt (χ², cells of expected count >= 5)."""
    temperature, n = 1.5, 3000
    out = generate(model, [Job(PROMPTS[1], temperature, seed) for seed in range(n)], max_new_tokens=1, stop_ids=[],
                   batch_size=8, topk=1)
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([PROMPTS[1]])).logits[0, -1] / temperature, -1)
    counts = torch.bincount(torch.tensor([g.tokens[0] for g in out]), minlength=probs.shape[0]).double()
    expected = probs * n
    common = expected >= 5
    observed = torch.cat([counts[common], counts[~common].sum()[None]])
    expected = torch.cat([expected[common], expected[~common].sum()[None]])
    assert chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-3


def test_models_the_lean_forward_cannot_run_are_refused():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32)).eval()
    with pytest.raises(ValueError, match="continuous batching runs on the lean forward, which cannot run this gpt2"):
        generate(gpt2, [Job([1, 2])], max_new_tokens=2, stop_ids=[], batch_size=1, topk=1)


@pytest.mark.parametrize("stop", [False, True])
def test_captured_features_are_the_teacher_forced_hidden_states_at_every_position(model, stop):
    """A feature draft's inputs recorded while the target generates (prompt and every new token, its last one fed
    once more for them) are what a teacher-forced pass over prompt + response gives."""
    from distill.data.features import teacher_forced_features

    layers = (0, 1)
    stop_ids = [greedy_reference(model, PROMPTS[0], 7)[2]] if stop else []
    jobs = [Job(p, 0.9 if i % 2 else 0.0, i) for i, p in enumerate(PROMPTS)] + [Job(PROMPTS[2], 0.0, 0)]
    plain = generate(model, jobs, max_new_tokens=7, stop_ids=stop_ids, batch_size=2, topk=3)
    out = generate(model, jobs, max_new_tokens=7, stop_ids=stop_ids, batch_size=2, topk=3, capture=layers)
    assert [g.tokens for g in out] == [g.tokens for g in plain] and plain[0].features is None
    sequences = [job.prompt + g.tokens for job, g in zip(jobs, out)]
    forced, offsets = teacher_forced_features(model, sequences, layers)
    for i, g in enumerate(out):
        assert g.features.dtype == torch.float16 and g.features.shape == (len(sequences[i]), 2 * 64)
        torch.testing.assert_close(g.features, forced[offsets[i] : offsets[i + 1]], atol=1e-3, rtol=1e-3)


def test_a_bf16_model_keeps_its_keys_and_values_and_attends_in_fp32_on_a_cpu(model):
    """bf16 projections, fp32 attention (`decode.runtime.lean.attention_dtype`): torch's bf16 CPU attention costs
    more than the bf16 products save. Rows refilled as they end still equal one sequence at a time in that mix."""
    half = copy.deepcopy(model).to(torch.bfloat16)
    assert attention_dtype(half) == torch.float32 and attention_dtype(model) == model.dtype  # its own otherwise
    lean = LeanDecoder(half, cache_dtype=attention_dtype(half))
    expected = []
    for prompt in PROMPTS:
        cache, tokens = lean.new_cache(), list(prompt)
        assert cache.keys[0].dtype == torch.float32
        with torch.inference_mode():
            logits = lean.forward_logits(torch.tensor(tokens), cache, 0, keep_last=True)
            for _ in range(6):
                tokens.append(int(logits[-1].argmax()))
                logits = lean.forward_logits(torch.tensor(tokens[-1:]), cache, len(tokens) - 1, keep_last=True)
        assert logits.dtype == torch.bfloat16  # the head still runs in the model's precision
        expected.append(tokens[len(prompt):] + [int(logits[-1].argmax())])
    out = generate(half, [Job(p) for p in PROMPTS], max_new_tokens=7, stop_ids=[], batch_size=2, topk=4)
    assert [g.tokens for g in out] == expected

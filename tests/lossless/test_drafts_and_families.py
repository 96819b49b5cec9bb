"""Speculative sampling must reproduce the target's warped distribution exactly, whatever the draft.

Tiny vocab (16), a 1-token prompt, γ=2 and 3 new tokens, so the first block exercises acceptance at both draft
positions, the residual resample and the bonus token. The empirical first- and second-token marginals and their
joint are compared with the exact distributions by a chi-square test.

Every supported family decodes losslessly too, through the lean forward and through the transformers forward: tiny
random-weight models of each (`tests.families`), chains and token trees, greedy against the family's own target-only
greedy (transformers, no cache, full forward) and sampled against its exact distribution. Sliding windows are
exercised with windows shorter than the text and the tree.
"""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from decode.factory import build_decoder, model_decoder
from decode.sampling import warp_logits
from decode.speculative import SpeculativeDecoder
from pipeline.config import DecodeConfig
from pipeline.sources import ResolvedModel
from tests.decode.tiny import greedy_reference, perturbed_copy, tiny_llama
from tests.families import FAMILIES, WINDOWED, perturbed, tiny_family

VOCAB = 16
PROMPT = [3]
SAMPLES = 1000


T1 = dict(temperature=1.0, top_k=0, top_p=1.0)


@torch.no_grad()
def exact_first_two(target, prompt: list[int], warp: dict) -> tuple[np.ndarray, np.ndarray]:
    """p(x1) [V] and the joint p(x1, x2) [V, V] of the target's warped sampling distribution after `prompt`."""
    vocab = target.get_output_embeddings().weight.shape[0]
    first = warp_logits(target(torch.tensor([prompt])).logits[0, -1], **warp).double()
    second = warp_logits(target(torch.tensor([prompt + [x] for x in range(vocab)])).logits[:, -1], **warp).double()
    return first.numpy(), (first[:, None] * second).numpy()


def check_first_two(target, decoder, prompt: list[int], warp: dict = T1, samples: int = SAMPLES) -> list:
    """Generate 3 tokens `samples` times (seeds 0, 1, ...) and chi-square the first two (both marginals and the joint)
    against the target's exact distribution; returns each generation's stats for the caller's own checks."""
    vocab = target.get_output_embeddings().weight.shape[0]
    pairs, stats = np.zeros((vocab, vocab)), []
    for seed in range(samples):
        result = decoder.generate(prompt, max_new_tokens=3, seed=seed, **warp)
        pairs[result.token_ids[0], result.token_ids[1]] += 1
        stats.append(result.stats)
    first, joint = exact_first_two(target, prompt, warp)
    assert_matches(pairs.sum(1), first)
    assert_matches(pairs.sum(0), joint.sum(0))
    assert_matches(pairs, joint)
    return stats


def assert_matches(observed: np.ndarray, expected_probs: np.ndarray) -> None:
    """Chi-square goodness of fit; impossible outcomes must never occur; cells expecting < 5 are pooled."""
    observed, expected = observed.ravel(), expected_probs.ravel() * observed.sum()
    assert observed[expected_probs.ravel() == 0].sum() == 0
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    result = chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum())
    assert result.pvalue > 1e-3, result


def mask_logits(model, tokens: list[int]) -> torch.nn.Module:
    """Give `tokens` zero probability in `model` (a hook on its lm_head)."""
    mask = torch.zeros(VOCAB, dtype=torch.float64)
    mask[tokens] = float("-inf")
    model.lm_head.register_forward_hook(lambda module, args, out: out + mask)
    return model


@pytest.fixture(scope="module")
def target():
    return tiny_llama(10, vocab_size=VOCAB, init_range=0.15)


def run_case(target, draft, warp: dict, token_ids=None, gamma: int = 2) -> float:
    stats = check_first_two(target, model_decoder(target, draft, gamma, draft_token_ids=token_ids), PROMPT, warp)
    return sum(s.accepted for s in stats) / sum(s.verified for s in stats)


WARPS = {
    "t1": dict(temperature=1.0, top_k=0, top_p=1.0),
    "t0.7_topk": dict(temperature=0.7, top_k=6, top_p=1.0),
    "top_p": dict(temperature=1.0, top_k=0, top_p=0.8),
}


@pytest.mark.parametrize("warp", [WARPS["t1"], WARPS["top_p"]], ids=["t1", "top_p"])
def test_lossless_with_close_draft(target, warp):
    alpha = run_case(target, perturbed_copy(target, seed=11, noise=0.15), warp)
    assert 0.2 < alpha < 0.95  # both acceptances and rejections happened


def test_lossless_with_random_draft_low_temperature_top_k(target):
    run_case(target, tiny_llama(12, vocab_size=VOCAB, init_range=0.15), WARPS["t0.7_topk"])


def test_lossless_with_reduced_vocab_draft(target):
    token_ids = torch.arange(0, VOCAB, 2)
    draft = tiny_llama(13, vocab_size=VOCAB, draft_vocab=len(token_ids), init_range=0.15)
    run_case(target, draft, WARPS["t1"], token_ids)


def test_lossless_with_disjoint_support_draft():
    target = mask_logits(tiny_llama(10, vocab_size=VOCAB, init_range=0.15), list(range(8, VOCAB)))
    token_ids = torch.arange(8, VOCAB)  # the draft only proposes tokens the target never emits
    draft = tiny_llama(14, vocab_size=VOCAB, draft_vocab=len(token_ids), init_range=0.15)
    assert run_case(target, draft, WARPS["t1"], token_ids) == 0.0


# --------------------------------------------------------------------------- every family

FAMILY_PROMPT = [5, 9, 2, 77, 3, 5, 9, 40, 11, 2, 77, 3]  # repeats: prompt lookup joins the default decoder's trees
NEW_TOKENS = 24
FAMILY_SAMPLES = 300  # a tree pass blind to the window fails at chi-square 140 (p < 1e-20) here


def resolved(model) -> ResolvedModel:
    return ResolvedModel("tiny", None, model, None, "", None)


def family_decoders(target, draft, lean: bool = True) -> dict[str, SpeculativeDecoder]:
    """The default decoder (token trees: prompt lookup, suffix decoding, the draft), a deep tree of the draft alone,
    and chain rounds."""
    default = DecodeConfig()
    return {"default": build_decoder(resolved(target), resolved(draft), default, lean=lean),
            "deep_tree": model_decoder(target, draft, 6, tree_budget=12, tree_branching=2, lean=lean),
            "chain": build_decoder(resolved(target), resolved(draft), default.chain_rounds(), lean=lean)}


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_is_the_targets_in_every_family(family, lean):
    # a window of 4 (where the family has one) is shorter than the text and than the deep tree; through the lean
    # forward (every family here) and through transformers'
    target = tiny_family(family, window=4 if family in WINDOWED else None)
    reference = greedy_reference(target, FAMILY_PROMPT, NEW_TOKENS)
    for name, decoder in family_decoders(target, perturbed(target, seed=1, noise=0.05), lean).items():
        assert (decoder.target_runner.lean is not None) == lean
        result = decoder.generate(FAMILY_PROMPT, max_new_tokens=NEW_TOKENS)
        assert result.token_ids == reference, name
        assert result.stats.accepted > 0, name


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
@pytest.mark.parametrize("family", FAMILIES)
def test_sampling_is_the_targets_distribution_in_every_family(family, lean):
    # two layers (Gemma's: one sliding, one global); a window of 2 cuts the second token's view of the prompt
    shape = dict(vocab_size=VOCAB, init_range=0.15, window=2 if family in WINDOWED else None, layers=2)
    target = tiny_family(family, 10, **shape)
    tree = model_decoder(target, perturbed(target, seed=11, noise=0.15), 2, tree_budget=6, tree_branching=3,
                         lean=lean)
    check_first_two(target, tree, [3, 7], T1, samples=FAMILY_SAMPLES)
    other = tiny_family(family, 12, **shape)  # an unrelated draft of the family
    check_first_two(target, model_decoder(target, other, 2, lean=lean), [3, 7], T1, samples=FAMILY_SAMPLES)

"""Tree rounds must reproduce the target's warped distribution exactly, whatever the tree holds.

First the acceptance rule alone (`decode.token_tree.accept_sampled`) on synthetic distributions over 5 tokens, where
trees can be built to force the hard cases: sampled siblings drawing the same token, a deterministic candidate and
sampled ones under one parent, siblings drawn without replacement, a draft whose support misses tokens. Then tree-round
decoding end to end with tiny models (`SpeculativeDecoder` with a tree budget). Both compare the empirical law of the
first two tokens with the exact one by a chi-square test (`tests.lossless.test_drafts_and_families.assert_matches`).
"""
from __future__ import annotations

import hashlib
from functools import cache

import numpy as np
import pytest
import torch

from decode.drafters.suffix import SuffixIndex
from decode.drafters.tree_drafter import make_tree_drafter, without_replacement
from decode.factory import model_decoder
from decode.sampling import Warp, sample
from decode.speculative import SpeculativeDecoder
from decode.token_tree import ROOT, TokenTree, accept_sampled
from tests.decode.tiny import perturbed_copy, tiny_llama
from tests.lossless.test_drafts_and_families import assert_matches, check_first_two

V = 5


@cache
def toy(name: str, prefix: tuple[int, ...], support: int = V) -> torch.Tensor:
    """A fixed distribution over V tokens for each (name, prefix), zero past the first `support` tokens."""
    seed = int.from_bytes(hashlib.sha256(repr((name, prefix)).encode()).digest()[:4], "little")
    logits = 2.0 * torch.randn(V, generator=torch.Generator().manual_seed(seed))
    logits[support:] = float("-inf")
    return logits.softmax(-1)


def p(prefix: tuple[int, ...]) -> torch.Tensor:
    return toy("target", prefix)


def draw(q: torch.Tensor, generator: torch.Generator) -> int:
    return int(sample(q, generator))


# A draft sure of a token the target rarely emits: its three draws mostly repeat that token, and each repeat must
# still update p (skipping repeats would shift the first token's law by 0.06).
REPEATING = torch.tensor([0.02, 0.03, 0.85, 0.05, 0.05])


def iid_siblings(generator, q: torch.Tensor = REPEATING, support: int = V) -> TokenTree:
    """Three siblings drawn with replacement from q, then one sampled child under each distinct one."""
    tree = TokenTree()
    for _ in range(3):
        tree.add(ROOT, draw(q, generator), "draft", q)
    for node in range(len(tree)):
        below = toy("draft", (tree.tokens[node],), support)
        tree.add(node, draw(below, generator), "draft", below)
    return tree


def lookup_then_draws(generator) -> TokenTree:
    """A deterministic candidate (token 1, then 3 below it), then two siblings drawn without replacement from q, which
    may draw token 1 again; a sampled child under each."""
    tree = TokenTree()
    tree.add(tree.add(ROOT, 1, "lookup"), 3, "lookup")
    q = toy("draft", ())
    picks = (q / torch.empty_like(q).exponential_(1, generator=generator)).topk(2).indices
    for pick, trial_q in zip(picks.tolist(), without_replacement(q, picks)):
        tree.add(ROOT, pick, "draft", trial_q)
    for node in range(len(tree)):
        if tree.depths[node] == 1:
            below = toy("draft", (tree.tokens[node],))
            tree.add(node, draw(below, generator), "draft", below)
    return tree


def first_two(tree: TokenTree, generator: torch.Generator) -> tuple[int, int]:
    """The round's first two tokens; when the round yields one, the second from the exact target (the next round)."""
    logits = torch.stack([p(())] + [p(tuple(tree.tokens[i] for i in tree.path(n))) for n in range(len(tree))]).log()
    verdict = accept_sampled(tree, logits, Warp(1.0), generator)
    out = [tree.tokens[n] for n in verdict.path] + [verdict.next_token]
    if len(out) == 1:
        out.append(draw(p((out[0],)), generator))
    return out[0], out[1]


@pytest.mark.parametrize("make", [
    iid_siblings,
    lookup_then_draws,
    lambda generator: iid_siblings(generator, toy("draft", (), 3), 3),  # a draft that never proposes tokens 3 and 4
], ids=["iid_siblings", "lookup_then_draws", "draft_support_3"])
def test_acceptance_over_trees_is_lossless(make):
    generator = torch.Generator().manual_seed(0)
    pairs = np.zeros((V, V))
    collisions = 0
    for _ in range(6000):
        tree = make(generator)
        collisions += len(tree.trials(ROOT)) > len(tree.children(ROOT))
        a, b = first_two(tree, generator)
        pairs[a, b] += 1
    first = p(()).double()
    joint = (first[:, None] * torch.stack([p((x,)) for x in range(V)]).double()).numpy()
    assert_matches(pairs.sum(1), first.numpy())
    assert_matches(pairs, joint)
    assert collisions > 500  # the hard case happened: a token proposed twice under the root


VOCAB = 16


@pytest.fixture(scope="module")
def target():
    return tiny_llama(10, vocab_size=VOCAB, init_range=0.15)


def run_case(target, decoder: SpeculativeDecoder, prompt: list[int], warp: dict) -> dict[str, int]:
    """Chi-square of the first two tokens (`check_first_two`); returns the accepted tokens by source."""
    by_source: dict[str, int] = {}
    for stats in check_first_two(target, decoder, prompt, warp):
        for source, n in stats.accepted_by_source.items():
            by_source[source] = by_source.get(source, 0) + n
    return by_source


def test_tree_decoding_is_lossless_with_a_close_draft(target):
    decoder = model_decoder(target, perturbed_copy(target, seed=11, noise=0.15), 2, tree_budget=6,
                                 tree_branching=3)
    assert run_case(target, decoder, [3], dict(temperature=1.0, top_k=0, top_p=1.0))["draft"] > 500


def test_tree_decoding_is_lossless_with_lookup_and_draft_in_one_tree(target):
    prompt = [3, 7, 3, 9, 3]  # "3" occurred twice before: lookup offers 9 and 7, the draft samples beside them
    decoder = model_decoder(target, perturbed_copy(target, seed=11, noise=0.15), 2, tree_budget=6,
                                 tree_branching=2, lookup_min_ngram=1)
    accepted = run_case(target, decoder, prompt, dict(temperature=1.0, top_k=0, top_p=0.8))
    assert accepted.get("lookup", 0) > 50 and accepted.get("draft", 0) > 50


def test_tree_decoding_is_lossless_with_a_reduced_vocabulary_draft(target):
    token_ids = torch.arange(0, VOCAB, 2)
    draft = tiny_llama(13, vocab_size=VOCAB, draft_vocab=len(token_ids), init_range=0.15)
    drafter = make_tree_drafter("draft", target, draft, budget=5, branching=2, draft_token_ids=token_ids)
    decoder = model_decoder(target, drafter, 2)
    run_case(target, decoder, [3], dict(temperature=0.7, top_k=6, top_p=1.0))


def test_tree_decoding_is_lossless_with_suffix_candidates_beside_sampled_draft_siblings(target):
    # after "3 5 7" the index has 14 twice (then 12) and 13 once: the suffix offers 14, its child 12, and 13 under the
    # root, deterministic; the draft samples siblings beside them in the rest of the budget
    index = SuffixIndex([[3, 5, 7, 14, 12], [3, 5, 7, 14, 12], [3, 5, 7, 13]])
    drafter = make_tree_drafter("decoder", target, perturbed_copy(target, seed=11, noise=0.15), budget=6, branching=2,
                                suffix=True, suffix_index=index)
    accepted = run_case(target, model_decoder(target, drafter, 2), [3, 5, 7],
                        dict(temperature=1.0, top_k=0, top_p=1.0))
    assert accepted.get("suffix", 0) > 300 and accepted.get("draft", 0) > 50

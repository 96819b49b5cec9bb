"""The model-free tree sources: prompt lookup's matches (`LookupTree`) and suffix decoding's candidate tree
(`SuffixTree`): two `decode.drafters.protocol.TreeSource`s."""
from __future__ import annotations

import torch

from decode.drafters.protocol import LOOKUP, SUFFIX
from decode.drafters.suffix import RequestTokens, SuffixDrafter
from decode.token_tree import ROOT, TokenTree


def lookup_matches(seq: list[int], k: int, max_ngram: int, min_ngram: int, branches: int) -> list[list[int]]:
    """Up to `branches` distinct continuations of up to k tokens that followed earlier occurrences of seq's last n
    tokens: n = max_ngram down to min_ngram, the most recent occurrence first (`decode.drafters.lookup` takes the
    first)."""
    found: list[list[int]] = []
    if k < 1 or len(seq) < 2:
        return found
    tokens = torch.tensor(seq)
    for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
        windows = tokens[:-1].unfold(0, n, 1)  # every n-gram that has at least one token after it
        for hit in (windows == tokens[-n:]).all(1).nonzero().flatten().tolist()[::-1]:
            continuation = seq[hit + n : hit + n + k]
            if continuation not in found:
                found.append(continuation)
                if len(found) == branches:
                    return found
    return found


class LookupTree:
    """Prompt lookup as a tree source: each of up to `branches` matches (`lookup_matches`) becomes a branch."""

    context = None  # no positions of its own
    feature_layers = ()

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, branches: int = 2):
        if not 1 <= min_ngram <= max_ngram or branches < 1:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram and branches >= 1, got {min_ngram}, {max_ngram}, "
                             f"{branches}")
        self.max_ngram, self.min_ngram, self.branches = max_ngram, min_ngram, branches
        self.name = f"lookup(n={min_ngram}..{max_ngram}, branches={branches})"

    def start(self, prompt: list[int]) -> None:
        return None

    def grow(self, state, tree: TokenTree, seq: list[int], budget: int, depth: int, warp, generator) -> int:
        limit = len(tree) + budget
        for branch in lookup_matches(seq, depth, self.max_ngram, self.min_ngram, self.branches):
            node = ROOT
            for token in branch:
                if len(tree) >= limit and tree.child(node, token) is None:
                    break
                node = tree.add(node, token, LOOKUP)
        return 0

    def commit(self, state, seq: list[int]) -> None:
        pass


class SuffixTree:
    """Suffix decoding as a tree source: `SuffixDrafter.candidates` within the round's budget and depth, added as
    deterministic candidates (chosen from the text alone, never from the target, so the test stays lossless). Its
    state is the request's tokens (`decode.drafters.suffix.RequestTokens`), brought up to date with the sequence every
    round."""

    context = None  # no positions of its own
    feature_layers = ()

    def __init__(self, drafter: SuffixDrafter):
        self.drafter, self.name = drafter, drafter.name

    def start(self, prompt: list[int]) -> RequestTokens:
        return self.drafter.start(prompt)

    def grow(self, state: RequestTokens, tree: TokenTree, seq: list[int], budget: int, depth: int, warp,
             generator) -> int:
        if budget < 1 or depth < 1:
            return 0
        found = self.drafter.candidates(state, seq, budget, depth)
        nodes: list[int] = []  # the tree's node of each candidate (a new one, or one another source proposed)
        for token, parent in zip(found.tokens, found.parents):
            nodes.append(tree.add(ROOT if parent < 0 else nodes[parent], token, SUFFIX))
        return 0

    def commit(self, state: RequestTokens, seq: list[int]) -> None:
        state.sync(seq)

"""What every proposer of draft tokens follows, and the names of the kinds.

A chain drafter (`Drafter`) proposes up to k tokens per round; a tree source (`TreeSource`) grows a token tree
under a node budget for one tree round (`decode.speculative.tree_round`). They sit apart from the drafters so that the
decoder (`decode.speculative`) and every reader of the kind names depend on them, not on a drafter.
"""
from __future__ import annotations

from typing import Protocol

import torch

from decode.sampling import Warp
from decode.token_tree import TokenTree

# The kinds. "draft": the draft model alone (`ModelDrafter`, or `decode.models.feature_draft.FeatureDrafter`), whose
# own acceptance is what drift is about; "lookup": prompt lookup alone (`decode.drafters.lookup.PromptLookupDrafter`),
# no model; "decoder": what users run, prompt lookup first wherever the text repeats and the draft model elsewhere
# (`decode.drafters.lookup.LookupThenModelDrafter`), or the draft alone when lookup is off. Tree rounds
# (`decode.drafters.tree_drafter.make_tree_drafter`) take one more, "suffix": suffix decoding alone
# (`decode.drafters.text_trees.SuffixTree`), no model; also the label of its tree nodes.
DRAFT, LOOKUP, DECODER, SUFFIX = "draft", "lookup", "decoder", "suffix"
DRAFTER_KINDS = (DRAFT, LOOKUP, DECODER)
TREE_DRAFTER_KINDS = (*DRAFTER_KINDS, SUFFIX)


class Drafter(Protocol):
    """`start(prompt)` returns its state for a new generation; `propose(state, seq, k, warp, generator)` returns up to
    k draft tokens continuing `seq`, their probabilities q on the target vocabulary (None when greedy: the greedy test
    reads the tokens only) and the number of model forwards it ran; `rollback(state, length)` forgets everything past
    the first `length` tokens of the sequence after a rejection. `context` is the number of positions it can see
    (None: no limit of its own); `name` says what it is in run records. A drafter that reads the target's hidden
    states names the layers in `feature_layers`; the decoder then captures them in every target pass and hands the
    kept positions' states to `observe(state, features)`."""

    name: str
    context: int | None
    feature_layers: tuple[int, ...]  # target layers whose input hidden states it reads (`observe`); () for tokens

    def start(self, prompt: list[int]) -> object: ...

    def propose(self, state, seq: list[int], k: int, warp: Warp,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None, int]: ...

    def rollback(self, state, length: int) -> None: ...


class TreeSource(Protocol):
    """`start(prompt)` returns its state for a new generation; `grow(state, tree, seq, budget, depth, warp, generator)`
    adds at most `budget` new nodes of at most `depth` levels to the round's tree continuing `seq` and returns the
    number of model forwards it ran; `commit(state, seq)` is told the sequence after the round, so a model source keeps
    what it computed along the accepted path. `feature_layers` and `observe` as for a `Drafter`. Sources label their
    nodes (`LOOKUP`, `DRAFT`, ...), and the decoder's statistics count accepted tokens per label.

    A source must keep the tree's sampled test lossless: every sampled trial's token is drawn from the q it carries
    given what was drawn before it, trials are added in the order they were drawn, and how many trials a node gets is
    decided before they are drawn. Deterministic candidates (q None) may be chosen any way that does not look at the
    target."""

    name: str
    context: int | None
    feature_layers: tuple[int, ...]  # target layers whose input hidden states it reads (`observe`); () for tokens

    def start(self, prompt: list[int]) -> object: ...

    def grow(self, state, tree: TokenTree, seq: list[int], budget: int, depth: int, warp: Warp,
             generator: torch.Generator | None) -> int: ...

    def commit(self, state, seq: list[int]) -> None: ...

"""What every proposer of draft tokens follows, and the names of the kinds.

A chain drafter (`Drafter`) proposes up to k tokens per round; a tree source (`TreeSource`) grows a token tree
under a node budget for one tree round (`decode.speculative.tree_round`).

A drafter has three methods. `start(prompt)` returns its state for a new generation; `propose(state, seq, k, warp,
generator)` returns up to k draft tokens continuing `seq`, their probabilities q on the target vocabulary (None when
greedy: the greedy test reads the tokens only) and the number of model forwards it ran; `rollback(state, length)`
forgets everything past the first `length` tokens of the sequence after a rejection. `context` is the number of
positions the drafter can see (None: no limit of its own), and `name` says what it is in run records. A drafter that
reads the target's hidden states (`decode.models.feature_draft.FeatureDrafter`) names the layers in `feature_layers`;
the decoder then captures them in every target pass and hands the kept positions' states to `observe(state, features)`.
Token-level drafters have `feature_layers = ()`.

The kinds (`DRAFTER_KINDS`):
- "draft": the draft model alone (`ModelDrafter`, or `decode.models.feature_draft.FeatureDrafter` for a feature draft):
the draft's own acceptance, which is what drift is about;
- "lookup": prompt lookup alone (`decode.drafters.lookup.PromptLookupDrafter`), no model;
- "decoder": what users run: prompt lookup first wherever the text repeats, the draft model elsewhere
  (`decode.drafters.lookup.LookupThenModelDrafter`), or the draft model alone when lookup is off.
Tree rounds (`decode.drafters.tree_drafter.make_tree_drafter`) take one more, `TREE_DRAFTER_KINDS`:
- "suffix": suffix decoding alone (`decode.drafters.text_trees.SuffixTree`), no model; also the label of its tree
nodes.
"""
from __future__ import annotations

from typing import Protocol

import torch

from decode.sampling import Warp
from decode.token_tree import TokenTree

DRAFT, LOOKUP, DECODER, SUFFIX = "draft", "lookup", "decoder", "suffix"
DRAFTER_KINDS = (DRAFT, LOOKUP, DECODER)
TREE_DRAFTER_KINDS = (*DRAFTER_KINDS, SUFFIX)


class Drafter(Protocol):
    name: str
    context: int | None
    feature_layers: tuple[int, ...]  # target layers whose input hidden states it reads (`observe`); () for tokens

    def start(self, prompt: list[int]) -> object: ...

    def propose(self, state, seq: list[int], k: int, warp: Warp,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None, int]: ...

    def rollback(self, state, length: int) -> None: ...


class TreeSource(Protocol):
    name: str
    context: int | None
    feature_layers: tuple[int, ...]  # target layers whose input hidden states it reads (`observe`); () for tokens

    def start(self, prompt: list[int]) -> object: ...

    def grow(self, state, tree: TokenTree, seq: list[int], budget: int, depth: int, warp: Warp,
             generator: torch.Generator | None) -> int: ...

    def commit(self, state, seq: list[int]) -> None: ...

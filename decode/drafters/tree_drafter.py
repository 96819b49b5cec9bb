"""Tree drafters: the draft model's tree sources and the drafter that runs a tree round's sources under one budget.

`ModelTree` grows the draft model's tree level by level, one draft forward per level (a per-level beam; in greedy
rounds the best candidates of all levels, EAGLE-2's rerank); `FeatureTree` grows the same tree from a feature draft
(`decode.models.feature_draft`). `TreeDrafter` is what the decoder runs: prompt lookup first, then suffix decoding's
candidates (the model-free sources of `decode.drafters.text_trees`), then the model fills what is left of a budget
fixed or set by the sequence's length (`decode.tree_budget_schedule`); `make_tree_drafter` builds it by kind. What
every source follows, the rules of a lossless tree included: `decode.drafters.protocol.TreeSource`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from decode.drafters.chain import ModelDrafter, output_size
from decode.drafters.protocol import DRAFT, LOOKUP, SUFFIX, TREE_DRAFTER_KINDS, TreeSource
from decode.drafters.suffix import SuffixDrafter, SuffixIndex
from decode.drafters.text_trees import LookupTree, SuffixTree
from decode.models.feature_draft import FEATURES, FeatureDraft, FeatureDrafter, FeatureState
from decode.runtime.forward import compact
from decode.sampling import Warp, to_target_vocab
from decode.token_tree import ROOT, TokenTree
from pipeline.context_schedule import ContextSchedule


@dataclass
class ModelTreeState:
    """The draft's cache, its tree of the last round, the cache slot of that tree's node 0 (the pending token's slot
    plus one) and how many of its nodes the draft has fed (the last level is never fed)."""

    cache: object
    tree: TokenTree | None = None
    base: int = 0
    fed: int = 0


class ModelTree:
    """The draft model's candidates, grown one level per draft forward (a per-level beam, after EAGLE-2).

    Level d+1 holds the `branching` best children of level d's nodes by cumulative draft probability (the product
    of the draft's probabilities down the path, which EAGLE-2 found tracks acceptance), so a confident path grows
    deep and an unsure one splits; at most `depth` levels and `budget` nodes. How many children a node gets is
    decided from the draft's sorted probabilities at that node, before choosing them. Greedy: they are its top
    tokens (deterministic candidates). Sampling: they are drawn without replacement from the warped draft q (the
    Gumbel top-k trick: in the order of q/E, E ~ Exp(1), they are successive draws), the j-th with q renormalized
    after removing the j-1 before it, which is the q its trial carries. With the drafter's `min_confidence`, a node
    below the first level gets children only where the draft's top probability there reaches it (a branch ends where
    the draft is unsure, as a chain block does). With branching 1 this is the drafter's chain.

    Greedy rounds the draft owns (no other source proposed before it) with `rerank` (EAGLE-2's rerank) keep the best
    `budget` of every candidate the beam saw instead of filling the budget level by level: each level's `branching`
    best nodes (by cumulative probability) get their `branching` best children as candidates, and the round's tree is
    the `budget` best candidates of all levels, so one confident path may go deep while an unsure root stays wide. A
    level is expanded (one more draft forward) only from nodes that could still enter those `budget` (a child's
    cumulative probability never exceeds its parent's) and, with `min_confidence`, whose cumulative probability
    reaches it. Behind lookup's or suffix decoding's candidates the draft fills a few nodes level by level, where a
    second forward rarely pays (docs/concepts.md#token-trees). Sampled rounds never rerank: which of the drawn trials
    to keep would depend on the draws.

    How the draft computes its logits is two methods, `_root_logits` (after the sequence) and `_level_logits` (at a
    level's nodes, in one forward with a tree mask); `FeatureTree` overrides them for a feature draft.
    """

    feature_layers = ()
    family = DRAFT  # what the name calls the model
    _min_length = 1  # the shortest sequence the draft can continue

    def __init__(self, drafter: ModelDrafter | FeatureDrafter, branching: int, rerank: bool = True):
        if branching < 1:
            raise ValueError(f"branching must be >= 1, got {branching}")
        self.drafter, self.branching, self.rerank = drafter, branching, rerank
        self.context = drafter.context
        sure = "" if drafter.min_confidence is None else f", min_confidence={drafter.min_confidence:g}"
        self.name = f"{self.family}(branching={branching}{sure}{', rerank' if rerank else ''})"

    def start(self, prompt: list[int]) -> ModelTreeState:
        return ModelTreeState(self.drafter.start(prompt))

    def grow(self, state, tree: TokenTree, seq: list[int], budget: int, depth: int, warp: Warp,
             generator: torch.Generator | None) -> int:
        if budget < 1 or depth < 1 or len(seq) < self._min_length:
            return 0
        if self.rerank and warp.greedy and not len(tree):
            return self._grow_reranked(state, tree, seq, budget, depth)
        own = TokenTree()
        logits, calls = self._root_logits(state, seq, own), 1
        level, scores = [ROOT], {ROOT: 1.0}
        for d in range(1, depth + 1):
            first = len(own)
            sure = d == 1 or self.drafter.min_confidence is None
            for parent, token, q, score in self._children(level, scores, logits, budget - first, warp, generator, sure):
                scores[own.add(parent, token, DRAFT, q)] = score
            level = list(range(first, len(own)))
            if d == depth or len(own) >= budget or not level:
                break
            logits = self._level_logits(state, own, first, seq)
            calls += 1
        tree.merge(own)
        return calls

    def _grow_reranked(self, state, tree: TokenTree, seq: list[int], budget: int, depth: int) -> int:
        """The greedy round's tree: the `budget` best candidates of all levels (see the class). `own`, the tree the
        draft feeds, holds the expanded candidates."""
        own = TokenTree()
        logits, calls = self._root_logits(state, seq, own), 1
        scores: list[float] = []  # every candidate's cumulative probability, in the order found
        parents: list[int] = []  # its parent candidate (ROOT on the first level)
        tokens: list[int] = []
        beam, node_of = [ROOT], {ROOT: ROOT}  # the candidates expanded last, and each expanded one's node in `own`
        sure = self.drafter.min_confidence or 0.0

        def best_first(candidates) -> list[int]:  # ties: the one found first (a parent before its children)
            return sorted(candidates, key=lambda i: (-scores[i], i))

        for d in range(1, depth + 1):
            top, index = logits.float().softmax(-1).topk(min(self.branching, logits.shape[-1]), -1)
            first = len(scores)
            for row, parent in enumerate(beam):
                base = 1.0 if parent == ROOT else scores[parent]
                for value, pick in zip(top[row].tolist(), index[row].tolist()):
                    scores.append(base * value)
                    parents.append(parent)
                    tokens.append(self._target_token(pick))
            if d == depth:
                break
            ranked = best_first(range(len(scores)))
            entry = scores[ranked[budget - 1]] if len(ranked) >= budget else 0.0  # what a child must beat to enter
            found = best_first(range(first, len(scores)))[: self.branching]
            beam = [i for i in found if scores[i] > entry and scores[i] >= sure]
            if not beam:
                break
            level = len(own)
            for i in beam:
                node_of[i] = own.add(node_of[parents[i]], tokens[i], DRAFT)
            logits = self._level_logits(state, own, level, seq)
            calls += 1
        nodes = {ROOT: ROOT}
        # parents before children: a child is found after its parent and never scores above it
        for i in sorted(best_first(range(len(scores)))[:budget]):
            nodes[i] = tree.add(nodes[parents[i]], tokens[i], DRAFT)
        return calls

    def _target_token(self, pick: int) -> int:
        """The target's id of the draft's output column `pick`."""
        return pick if self.drafter.token_ids is None else int(self.drafter.token_ids[pick])

    def _root_logits(self, state: ModelTreeState, seq: list[int], own: TokenTree) -> torch.Tensor:
        """The draft's logits [1, V'] after `seq`, feeding what it has not seen; `own` is the tree to come."""
        state.tree, state.base, state.fed = own, len(seq), 0
        seen = state.cache.get_seq_length()
        return self.drafter.runner.forward(torch.tensor(seq[seen:], device=self.drafter.device), state.cache, seen,
                                           True)

    def _level_logits(self, state: ModelTreeState, own: TokenTree, first: int, seq: list[int]) -> torch.Tensor:
        """The draft's logits [n, V'] at nodes first.. of `own` (a level), fed in one forward with a tree mask."""
        device = self.drafter.device
        positions = torch.tensor([len(seq) - 1 + depth for depth in own.depths[first:]], device=device)
        mask = own.attention_mask(device)[first + 1 :, 1:]
        logits = self.drafter.runner.forward_tree(torch.tensor(own.tokens[first:], device=device), state.cache,
                                                  len(seq) + first, positions, mask)
        state.fed = len(own)
        return logits

    def _children(self, level: list[int], scores: dict[int, float], logits: torch.Tensor, budget: int, warp: Warp,
                  generator, sure: bool) -> list[tuple[int, int, torch.Tensor | None, float]]:
        """(parent, token, q of the trial or None, cumulative score) of the next level, in draw order; logits
        [len(level), V] are the draft's at the level's nodes; unless `sure`, only nodes where the draft is confident
        get children."""
        base = [scores[node] for node in level]
        plain = logits.float().softmax(-1)
        probs = plain if warp.greedy else warp(logits)
        top, index = probs.topk(min(self.branching, probs.shape[-1]), -1)
        candidates = torch.tensor(base, device=top.device)[:, None] * top
        if not sure:
            candidates[plain.amax(-1) < self.drafter.min_confidence] = 0
        chosen = candidates.flatten().topk(min(budget, self.branching, candidates.numel())).indices
        counts = [0] * len(level)
        for flat in chosen[candidates.flatten()[chosen] > 0].tolist():
            counts[flat // top.shape[1]] += 1
        out = []
        for row, (parent, count) in enumerate(zip(level, counts)):
            if warp.greedy:
                picks, trial_qs = index[row, :count], [None] * count
            else:
                picks = (probs[row] / torch.empty_like(probs[row]).exponential_(1, generator=generator)).topk(count)[1]
                trial_qs = list(without_replacement(probs[row], picks))
            for j, pick in enumerate(picks.tolist()):
                q = None if trial_qs[j] is None else to_target_vocab(trial_qs[j], self.drafter.token_ids,
                                                                     self.drafter.vocab_size)
                out.append((parent, self._target_token(pick), q, base[row] * float(probs[row, pick])))
        return out

    def commit(self, state: ModelTreeState, seq: list[int]) -> None:
        """Keep the fed nodes along `seq` in the draft's cache (moved next to the prefix); the rest is dropped. Never
        the last token: the next round's draft forward starts from it (a reranked tree may have fed, and then left
        out, the node of the target's bonus token)."""
        if state.tree is None:
            return
        node, slots = ROOT, []
        for token in seq[state.base : -1]:
            node = state.tree.child(node, token)
            if node is None or node >= state.fed:
                break
            slots.append(state.base + node)
        compact(state.cache, state.base, slots)
        state.tree = None


@dataclass
class FeatureTreeState:
    """A feature tree's drafter state, and the draft's output hidden states of this round: row 0 after the sequence,
    row 1 + i at node i of its tree (the next level's nodes pair them with their tokens)."""

    features: FeatureState
    outputs: torch.Tensor | None = None


class FeatureTree(ModelTree):
    """`ModelTree` from a feature draft (`decode.models.feature_draft.FeatureDrafter`), EAGLE-2's dynamic tree: the
    root's logits come from the target's features of the last round's accepted positions, and a node of level d+1 pairs
    its parent's output hidden state with its own token, at its depth's position. The draft's entries of a round's tree
    are dropped when it ends: the accepted positions come back as target features (`observe`)."""

    family = FEATURES
    _min_length = 2  # a one-token prompt: no target features yet

    def __init__(self, drafter: FeatureDrafter, branching: int, rerank: bool = True):
        super().__init__(drafter, branching, rerank)
        self.feature_layers = drafter.feature_layers

    def start(self, prompt: list[int]) -> FeatureTreeState:
        return FeatureTreeState(self.drafter.start(prompt))

    def observe(self, state: FeatureTreeState, features: torch.Tensor) -> None:
        self.drafter.observe(state.features, features)

    def _root_logits(self, state: FeatureTreeState, seq: list[int], own: TokenTree) -> torch.Tensor:
        state.outputs = self.drafter.feed_pending(state.features, seq)
        return self.drafter.model.logits(state.outputs)

    def _level_logits(self, state: FeatureTreeState, own: TokenTree, first: int, seq: list[int]) -> torch.Tensor:
        device, model = self.drafter.device, self.drafter.model
        hidden = state.outputs[[1 + parent for parent in own.parents[first:]]]
        positions = torch.tensor([len(seq) - 1 + depth for depth in own.depths[first:]], device=device)
        mask = own.attention_mask(device)[first + 1 :, 1:]
        out = model.step(hidden, torch.tensor(own.tokens[first:], device=device), state.features.cache,
                         state.features.verified + first, positions, mask)
        state.outputs = torch.cat([state.outputs, out])
        return model.logits(out)

    def commit(self, state: FeatureTreeState, seq: list[int]) -> None:
        state.features.cache.crop(state.features.verified)
        state.outputs = None


def without_replacement(q: torch.Tensor, picks: torch.Tensor):
    """The distribution each of successive draws `picks` without replacement came from: q, then q without the
    earlier picks, renormalized."""
    rest = q
    for pick in picks.tolist():
        yield rest
        rest = rest.clone()
        rest[pick] = 0
        rest = rest / rest.sum()


class TreeDrafter:
    """What the decoder runs in tree rounds: `sources` in order, each given what is left of the round's node budget
    (one `decode.token_tree.TokenTree` per round, identical prefixes merged).

    The budget is `budget` nodes every round, or, with `schedule` [(max_context, budget), ...] (increasing
    max_context), that of the first entry whose max_context is at least the current sequence length, the last
    beyond them (`pipeline.context_schedule`, as γ by context is picked).
    """

    def __init__(self, sources: Sequence[TreeSource], budget: int = 0,
                 schedule: Sequence[Sequence[int]] | None = None):
        if not sources or (budget < 1) == (schedule is None):
            raise ValueError(f"a tree drafter needs sources and either a budget >= 1 or a schedule, got "
                             f"{len(sources)} sources, budget {budget} and schedule {schedule}")
        self.sources = list(sources)
        layers = {s.feature_layers for s in self.sources if s.feature_layers}
        if len(layers) > 1:
            raise ValueError(f"the tree's sources read different target layers: {sorted(layers)}")
        self.feature_layers = layers.pop() if layers else ()  # what the decoder captures in its target passes
        self.schedule = None if schedule is None else ContextSchedule.parse(schedule, "tree_budget_schedule")
        self.budget = self.schedule.largest() if self.schedule else budget  # the most nodes of any round
        contexts = [s.context for s in self.sources if s.context]
        self.context = min(contexts) if contexts else None
        shown = f"budget={budget}" if budget else f"budget_schedule={self.schedule.as_lists()}"
        self.name = f"tree({shown}): " + "+".join(s.name for s in self.sources)

    def budget_at(self, length: int) -> int:
        """The node budget of a round after a sequence of `length` tokens."""
        return self.schedule.at(length) if self.schedule else self.budget

    def start(self, prompt: list[int]) -> list:
        return [source.start(prompt) for source in self.sources]

    def grow(self, states: list, seq: list[int], depth: int, warp: Warp, generator) -> tuple[TokenTree, int]:
        """The round's tree of at most `depth` levels and its draft model forwards."""
        tree, calls, budget = TokenTree(), 0, self.budget_at(len(seq))
        for source, state in zip(self.sources, states):
            calls += source.grow(state, tree, seq, budget - len(tree), depth, warp, generator)
        return tree, calls

    def commit(self, states: list, seq: list[int]) -> None:
        for source, state in zip(self.sources, states):
            source.commit(state, seq)

    def observe(self, states: list, features: torch.Tensor) -> None:
        """The target's features at the positions kept since the last call, for the sources that read them."""
        for source, state in zip(self.sources, states):
            if source.feature_layers:
                source.observe(state, features)


def make_tree_drafter(kind: str, target, draft=None, *, budget: int = 0,
                      budget_schedule: Sequence[Sequence[int]] | None = None, branching: int = 2,
                      draft_token_ids: torch.Tensor | None = None, lookup_min_ngram: int | None = None,
                      suffix: bool = False, suffix_index: SuffixIndex | None = None,
                      draft_min_confidence: float | None = None, draft_rerank: bool = True,
                      lean: bool = True) -> TreeDrafter:
    """The tree drafter of `kind` (`decode.drafters.protocol.TREE_DRAFTER_KINDS`): "draft" the model's tree, "lookup"
    prompt lookup's branches (n-grams of 1-3 tokens unless `lookup_min_ngram` is set), "decoder" lookup's branches first
    and the model's tree in what is left of the budget (the model alone when lookup is off), "suffix" suffix
    decoding's candidates alone. With `suffix`, "lookup" and "decoder" add suffix decoding's candidates after
    lookup's ("draft" stays the model alone). Suffix decoding (`SuffixTree`) searches `suffix_index` and the request,
    the request alone when the index is None. `budget` nodes per round, or by sequence length from `budget_schedule`
    (`TreeDrafter`); `branching`: nodes per level of the model's tree, and lookup branches; `draft_min_confidence`,
    `draft_rerank`: see `ModelTree`. target: the target model, None for the trees grown without a draft model
    ("lookup", "suffix"), which read the text alone."""
    if kind not in TREE_DRAFTER_KINDS:
        raise ValueError(f"tree drafter kind must be one of {TREE_DRAFTER_KINDS}, got {kind!r}")
    lookup_ngrams = (3, 1) if lookup_min_ngram is None else (max(3, lookup_min_ngram), lookup_min_ngram)
    size = {"budget": budget, "schedule": budget_schedule}
    suffix_sources = [SuffixTree(SuffixDrafter(suffix_index, None))] if suffix or kind == SUFFIX else []
    if kind == SUFFIX:
        return TreeDrafter(suffix_sources, **size)
    if kind == LOOKUP:
        return TreeDrafter([LookupTree(*lookup_ngrams, branching), *suffix_sources], **size)
    if draft is None:
        raise ValueError(f"the {kind!r} drafter needs a draft model")
    vocab_size, device = output_size(target), next(target.parameters()).device
    if isinstance(draft, FeatureDraft):
        if draft_token_ids is not None:
            raise ValueError("a feature draft carries its own vocabulary: pass no draft_token_ids")
        model = FeatureTree(FeatureDrafter(draft, vocab_size, device, min_confidence=draft_min_confidence), branching,
                            draft_rerank)
    else:
        model = ModelTree(ModelDrafter(draft, vocab_size, device, token_ids=draft_token_ids,
                                       min_confidence=draft_min_confidence, lean=lean), branching, draft_rerank)
    if kind == DRAFT:
        return TreeDrafter([model], **size)
    lookup = [] if lookup_min_ngram is None else [LookupTree(*lookup_ngrams, branching)]
    return TreeDrafter([*lookup, *suffix_sources, model], **size)

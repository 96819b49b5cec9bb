"""Token trees: the tree type, the tree forward against per-path plain forwards, KV compaction, the greedy walk, the
sources, and tree-round decoding against target-only greedy decoding."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

from decode.drafters.chain import ModelDrafter
from decode.drafters.protocol import DRAFT, LOOKUP
from decode.drafters.text_trees import LookupTree, lookup_matches
from decode.drafters.tree_drafter import ModelTree, ModelTreeState, TreeDrafter, make_tree_drafter
from decode.factory import build_decoder, model_decoder
from decode.generation_stats import GenerationStats
from decode.runtime.forward import ModelRunner, compact, forward_logits, rollback
from decode.sampling import Warp
from decode.token_tree import ROOT, TokenTree, accept_greedy, accept_sampled
from pipeline.config import DecodeConfig
from pipeline.sources import ResolvedModel
from tests.decode.tiny import greedy_reference, perturbed_copy, tiny_llama


def build(edges: list[tuple[int, int]], source: str = "s") -> TokenTree:
    """A tree from (parent, token) pairs in order."""
    tree = TokenTree()
    for parent, token in edges:
        tree.add(parent, token, source)
    return tree


# 0:7  1:9 (under 0)  2:11  3:3 (under 0)  4:4 (under 1)  5:5 (under 2)
SHAPE = [(ROOT, 7), (0, 9), (ROOT, 11), (0, 3), (1, 4), (2, 5)]


def test_tree_structure_and_mask():
    tree = build(SHAPE)
    assert tree.parents == [ROOT, 0, ROOT, 0, 1, 2] and tree.depths == [1, 2, 1, 2, 3, 2] and tree.depth == 3
    assert tree.children(ROOT) == [0, 2] and tree.children(0) == [1, 3] and tree.path(4) == [0, 1, 4]
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0],  # the pending token
        [1, 1, 0, 0, 0, 0, 0],  # 7
        [1, 1, 1, 0, 0, 0, 0],  # 7 9
        [1, 0, 0, 1, 0, 0, 0],  # 11
        [1, 1, 0, 0, 1, 0, 0],  # 7 3
        [1, 1, 1, 0, 0, 1, 0],  # 7 9 4
        [1, 0, 0, 1, 0, 0, 1],  # 11 5
    ], dtype=torch.bool)
    assert torch.equal(tree.attention_mask(), expected)


def test_same_token_under_same_parent_is_one_node_and_trials_keep_their_order():
    tree = TokenTree()
    q = torch.tensor([0.5, 0.5])
    assert tree.add(ROOT, 1, "lookup") == 0
    assert tree.add(ROOT, 1, "lookup") == 0  # a repeated deterministic candidate is no new trial
    assert tree.add(ROOT, 0, "draft", q) == 1
    assert tree.add(ROOT, 1, "draft", q) == 0  # a sampled repeat is a trial of its own
    assert len(tree) == 2 and tree.sources == ["lookup", "draft"]
    assert [(t.node, t.q is None) for t in tree.trials(ROOT)] == [(0, True), (1, False), (0, False)]
    other = build([(ROOT, 0), (0, 6), (ROOT, 2)], "other")
    tree.merge(other)
    assert tree.tokens == [1, 0, 2, 6] and tree.parents == [ROOT, ROOT, ROOT, 1]  # merged parent by parent
    assert tree.sources == ["lookup", "draft", "other", "other"]
    assert [t.node for t in tree.trials(ROOT)] == [0, 1, 0, 1, 2]  # other's trials after the tree's own


def test_greedy_walk_follows_the_argmax():
    tree = build(SHAPE)
    logits = torch.zeros(len(tree) + 1, 16)
    for row, argmax in enumerate([7, 3, 0, 5, 1, 2, 8]):  # pending -> 7 -> 3 (node 3, a leaf) -> its argmax 1
        logits[row, argmax] = 1.0
    verdict = accept_greedy(tree, logits)
    assert (verdict.path, verdict.next_token, verdict.tested) == ([0, 3], 1, 2)
    logits[0] = 0
    logits[0, 12] = 1.0  # no first-level node is the argmax
    verdict = accept_greedy(tree, logits)
    assert (verdict.path, verdict.next_token, verdict.tested) == ([], 12, 1)


def test_sampled_walk_with_greedy_warp_is_the_greedy_walk():
    generator = torch.Generator().manual_seed(0)
    for seed in range(20):
        torch.manual_seed(seed)
        tree = TokenTree()
        for _ in range(12):
            tree.add(int(torch.randint(-1, len(tree), ())), int(torch.randint(0, 4, ())), "s")
        logits = torch.randn(len(tree) + 1, 4)
        assert accept_sampled(tree, logits, Warp(0.0), generator) == accept_greedy(tree, logits)


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
@torch.inference_mode()
def test_tree_forward_gives_each_node_its_path_logits_and_compaction_the_path_cache(lean):
    model = tiny_llama(5)
    runner = ModelRunner(model, lean)
    assert (runner.lean is not None) == lean
    prefix = torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    tree = build(SHAPE)
    cache, start = runner.new_cache(), len(prefix) - 1
    runner.forward(torch.tensor(prefix[:-1]), cache, 0, True)
    logits = runner.forward_tree(torch.tensor(prefix[-1:] + tree.tokens), cache, start,
                                 start + torch.tensor([0, *tree.depths]), tree.attention_mask())
    for node in range(len(tree)):
        path = prefix + [tree.tokens[i] for i in tree.path(node)]
        torch.testing.assert_close(logits[node + 1], model(torch.tensor([path])).logits[0, -1], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(logits[0], model(torch.tensor([prefix])).logits[0, -1], rtol=1e-10, atol=1e-10)
    # keep 7 9 4 (nodes 0 1 4), then go on decoding: the same as after feeding the path plainly
    compact(cache, start + 1, [start + 1 + node for node in tree.path(4)])
    assert cache.get_seq_length() == len(prefix) + 3
    accepted = prefix + [7, 9, 4]
    reference = DynamicCache(config=model.config)
    forward_logits(model, torch.tensor(accepted), reference, 0, True)
    for step, block in enumerate([[5], [6, 2, 8]]):
        at = len(accepted) + (0 if step == 0 else 1)
        got = runner.forward(torch.tensor(block), cache, at, False)
        torch.testing.assert_close(got, forward_logits(model, torch.tensor(block), reference, at, False),
                                   rtol=1e-10, atol=1e-10)
    rollback(cache, 5)
    assert cache.get_seq_length() == 5


def test_lookup_matches_the_most_recent_occurrences_of_the_longest_ngram_first():
    seq = [1, 2, 3, 9, 1, 2, 4, 5, 2, 6, 1, 2]
    # "1 2" occurs at 4 (-> 4 5) and at 0 (-> 3 9); then "2" at 8 (-> 6 1)
    assert lookup_matches(seq, 2, 3, 1, 3) == [[4, 5], [3, 9], [6, 1]]
    assert lookup_matches(seq, 2, 3, 2, 3) == [[4, 5], [3, 9]]
    assert lookup_matches(seq, 3, 3, 1, 1) == [[4, 5, 2]]
    assert lookup_matches([1, 2], 2, 3, 1, 2) == []


def test_lookup_tree_respects_the_budget():
    seq = [1, 2, 3, 9, 1, 2, 4, 5, 2, 6, 1, 2]
    tree = TokenTree()
    LookupTree(3, 1, 3).grow(None, tree, seq, 5, 2, Warp(), None)
    assert tree.tokens == [4, 5, 3, 9, 6] and tree.parents == [ROOT, 0, ROOT, 2, ROOT]
    assert set(tree.sources) == {"lookup"}


@pytest.mark.parametrize("min_confidence,length", [(None, 4), (0.3, 3)])  # the draft's 4th top prob is 0.24
@torch.inference_mode()
def test_a_draft_grown_tree_with_branching_one_is_the_greedy_chain(random_draft, min_confidence, length):
    seq = [40, 41, 42, 43]
    chain = ModelDrafter(random_draft, 128, torch.device("cpu"), min_confidence=min_confidence)
    drafts, _, calls = chain.propose(chain.start(seq), seq, 4, Warp(), None)
    source = ModelTree(ModelDrafter(random_draft, 128, torch.device("cpu"), min_confidence=min_confidence), 1,
                       rerank=False)
    tree, state = TokenTree(), source.start(seq)
    assert source.grow(state, tree, seq, 8, 4, Warp(), None) == calls
    assert tree.tokens == drafts.tolist() and len(tree) == length and tree.parents == [ROOT, 0, 1, 2][:length]


@torch.inference_mode()
def test_draft_grown_tree_levels_keep_the_best_children_by_cumulative_probability(target, close_draft):
    seq = [5, 9, 2, 77, 3]
    source = ModelTree(ModelDrafter(close_draft, 128, torch.device("cpu")), 2, rerank=False)
    tree, state = TokenTree(), source.start(seq)
    assert source.grow(state, tree, seq, 7, 3, Warp(), None) == 3  # the prefix, then levels 1 and 2 (3 is not fed)
    assert tree.depths == [1, 1, 2, 2, 3, 3] and len(tree) == 6  # two per level, depth 3 reached first
    probs = {}
    for node in range(len(tree)):
        path = seq + [tree.tokens[i] for i in tree.path(node)]
        logits = close_draft(torch.tensor([path[:-1]])).logits[0, -1].softmax(-1)
        probs[node] = logits[path[-1]] * (1.0 if tree.parents[node] == ROOT else probs[tree.parents[node]])
    first = close_draft(torch.tensor([seq])).logits[0, -1]
    assert tree.tokens[:2] == first.topk(2).indices.tolist()
    for level in ([2, 3], [4, 5]):  # each level: the two best of its parents' top-2 children, best first
        parents = sorted({tree.parents[n] for n in level})
        candidates = []
        for parent in [n for n in range(len(tree)) if tree.depths[n] == tree.depths[level[0]] - 1]:
            path = seq + [tree.tokens[i] for i in tree.path(parent)]
            top = close_draft(torch.tensor([path])).logits[0, -1].softmax(-1).topk(2)
            candidates += [(float(probs[parent] * v), parent, int(t)) for v, t in zip(top.values, top.indices)]
        best = sorted(candidates, reverse=True)[:2]
        assert sorted((p, t) for _, p, t in best) == sorted((tree.parents[n], tree.tokens[n]) for n in level)
        assert parents == sorted({p for _, p, _ in best})
    # the next round's cache: the fed nodes along the accepted path, moved next to the prefix
    accepted = [tree.tokens[i] for i in tree.path(4)]
    source.commit(state, seq + accepted + [1])
    assert state.cache.get_seq_length() == len(seq) + 2  # nodes of levels 1-2 were fed; level 3 was not


class TableTree(ModelTree):
    """A model tree whose draft probabilities come from a table: path of tokens after the sequence -> {token: p}
    (what is left of 1 spread over tokens 10-19); it records every path it was asked about, per forward."""

    def __init__(self, table: dict[tuple[int, ...], dict[int, float]], branching: int,
                 min_confidence: float | None, rerank: bool = True):
        drafter = SimpleNamespace(min_confidence=min_confidence, token_ids=None, context=None, vocab_size=20)
        super().__init__(drafter, branching, rerank)
        self.table, self.forwards = table, []

    def start(self, prompt):
        return ModelTreeState(None)

    def _logits(self, paths: list[tuple[int, ...]]) -> torch.Tensor:
        self.forwards.append(paths)
        rows = []
        for path in paths:
            probs = torch.zeros(20, dtype=torch.float64)
            for token, p in self.table.get(path, {}).items():
                probs[token] = p
            probs[10:] += (1 - probs.sum()) / 10
            rows.append(probs.log())
        return torch.stack(rows)

    def _root_logits(self, state, seq, own):
        return self._logits([()])

    def _level_logits(self, state, own, first, seq):
        return self._logits([tuple(own.tokens[i] for i in own.path(n)) for n in range(first, len(own))])

    def commit(self, state, seq):
        pass


SURE_ROOT = {(): {1: 0.6, 2: 0.3, 3: 0.02, 4: 0.01}, (1,): {5: 0.9}, (1, 5): {6: 0.5}, (2,): {7: 0.2}}


def test_a_reranked_tree_is_the_budgets_best_candidates_of_all_levels():
    source = TableTree(SURE_ROOT, branching=4, min_confidence=0.4)
    tree = TokenTree()
    assert source.grow(source.start([0]), tree, [0], 4, 3, Warp(), None) == 3
    # candidates by cumulative probability: 1 0.6, 1-5 0.54, 2 0.3, 1-5-6 0.27, then 3 0.02 and the rest below
    assert tree.tokens == [1, 2, 5, 6] and tree.parents == [ROOT, ROOT, 0, 2]
    # only the root's 1 (0.6 >= 0.4) and then 1-5 (0.54) were sure enough to expand
    assert source.forwards == [[()], [(1,)], [(1, 5)]]
    assert [tree.sources[n] for n in range(4)] == [DRAFT] * 4


def test_the_per_level_beam_of_the_same_draft_fills_the_first_level():
    source = TableTree(SURE_ROOT, branching=4, min_confidence=0.4, rerank=False)
    tree = TokenTree()
    assert source.grow(source.start([0]), tree, [0], 4, 3, Warp(), None) == 1
    assert tree.tokens == [1, 2, 3, 4] and tree.depth == 1


def test_an_unsure_root_stays_one_level_and_a_tie_at_the_budget_is_not_expanded():
    unsure = TableTree({(): {1: 0.3, 2: 0.2, 3: 0.1, 4: 0.05}}, branching=4, min_confidence=0.4)
    tree = TokenTree()
    assert unsure.grow(unsure.start([0]), tree, [0], 4, 3, Warp(), None) == 1
    assert tree.tokens == [1, 2, 3, 4]
    # no confidence floor: the root's two best tie at 0.45 and fill the budget of 2, so no child of either could
    # enter it (a child scores at most its parent's 0.45) and no draft forward is spent on them
    tied = TableTree({(): {1: 0.45, 2: 0.45}}, branching=2, min_confidence=None)
    tree = TokenTree()
    assert tied.grow(tied.start([0]), tree, [0], 2, 3, Warp(), None) == 1
    assert sorted(tree.tokens) == [1, 2]
    # with a third slot the best's children compete: 1-x scores at most 0.45 x, 2's sibling chain likewise
    tree = TokenTree()
    assert tied.grow(tied.start([0]), tree, [0], 3, 2, Warp(), None) == 2
    assert tied.forwards[-1] == [(1,), (2,)] and len(tree) == 3 and tree.depth == 2


def test_reranking_is_left_to_greedy_rounds_the_draft_owns():
    source = TableTree(SURE_ROOT, branching=4, min_confidence=0.4)
    shared = TokenTree()
    shared.add(ROOT, 9, LOOKUP)  # another source's candidate came first: the draft fills the rest level by level
    assert source.grow(source.start([0]), shared, [0], 3, 3, Warp(), None) == 1
    assert shared.tokens == [9, 1, 2, 3]
    sampled = TokenTree()
    source.grow(source.start([0]), sampled, [0], 4, 3, Warp(1.0, 0, 1.0), torch.Generator().manual_seed(0))
    assert all(trial.q is not None for trial in sampled.trials(ROOT))  # drawn trials: the per-level beam


@torch.inference_mode()
def test_the_draft_cache_never_keeps_the_last_token_so_the_next_round_has_one_to_feed(close_draft):
    """A reranked tree may feed a node and then leave it out; when the target's bonus token is that node's, the draft
    must still start the next round from it."""
    seq = [5, 9, 2, 77, 3]
    source = ModelTree(ModelDrafter(close_draft, 128, torch.device("cpu")), 2, rerank=False)
    tree, state = TokenTree(), source.start(seq)
    source.grow(state, tree, seq, 4, 2, Warp(), None)  # level 1 fed, level 2 not
    bonus = tree.tokens[1]  # a fed node's token as the round's last token
    source.commit(state, seq + [bonus])
    assert state.cache.get_seq_length() == len(seq)
    after = TokenTree()
    assert source.grow(state, after, seq + [bonus], 4, 2, Warp(), None) == 2 and len(after) == 4


@pytest.mark.parametrize("budget,branching,gamma", [(4, 4, 5), (6, 2, 4), (10, 3, 6)])
def test_reranked_draft_trees_give_target_greedy_output(target, close_draft, random_draft, reduced_draft, budget,
                                                        branching, gamma):
    prompt = [5, 9, 2, 77, 3, 5, 9]
    expected = greedy_reference(target, prompt, 40)
    token_ids = reduced_draft[1]
    drafters = [make_tree_drafter("draft", target, close_draft, budget=budget, branching=branching),
                make_tree_drafter("draft", target, random_draft, budget=budget, branching=branching,
                                  draft_min_confidence=0.1),
                make_tree_drafter("draft", target, reduced_draft[0], budget=budget, branching=branching,
                                  draft_token_ids=token_ids)]
    for drafter in drafters:
        result = model_decoder(target, drafter, gamma).generate(prompt, max_new_tokens=40)
        assert result.token_ids == expected
        assert result.stats.accepted_by_source.get(DRAFT, 0) == result.stats.accepted


@pytest.mark.parametrize("budget,branching,gamma", [(1, 1, 4), (4, 2, 4), (9, 3, 3), (12, 2, 6), (6, 4, 5)])
def test_tree_rounds_give_target_greedy_output(target, close_draft, random_draft, budget, branching, gamma):
    prompt = [5, 9, 2, 77, 3, 5, 9]
    expected = greedy_reference(target, prompt, 40)
    for draft in (close_draft, random_draft):
        decoder = model_decoder(target, draft, gamma, tree_budget=budget, tree_branching=branching,
                                     lookup_min_ngram=1)
        result = decoder.generate(prompt, max_new_tokens=40)
        assert result.token_ids == expected
        assert sum(result.stats.accepted_by_source.values()) == result.stats.accepted
        assert result.stats.new_tokens == result.stats.accepted + result.stats.target_calls


def test_tree_rounds_with_a_reduced_vocabulary_draft_and_without_the_lean_forward(target, reduced_draft):
    draft, token_ids = reduced_draft
    prompt = [5, 9, 2, 77, 3]
    expected = greedy_reference(target, prompt, 30)
    for lean in (True, False):
        decoder = model_decoder(target, draft, 4, draft_token_ids=token_ids, tree_budget=6, lean=lean)
        assert decoder.generate(prompt, max_new_tokens=30).token_ids == expected


def test_tree_rounds_in_float32():
    target = tiny_llama(0).float()
    draft = perturbed_copy(target, seed=2, noise=0.03).float()
    prompt = [5, 9, 2, 77, 3]
    decoder = model_decoder(target, draft, 5, tree_budget=10, tree_branching=2)
    assert decoder.generate(prompt, max_new_tokens=40).token_ids == greedy_reference(target, prompt, 40)


def test_a_lookup_tree_alone(target):
    prompt = [5, 9, 2, 5, 9, 7, 5]
    decoder = model_decoder(target, make_tree_drafter("lookup", target, budget=6), 3)
    result = decoder.generate(prompt, max_new_tokens=30)
    assert result.token_ids == greedy_reference(target, prompt, 30)
    assert result.stats.draft_calls == 0 and set(result.stats.accepted_by_source) <= {"lookup"}


def test_stats_of_a_tree_round():
    stats = GenerationStats()
    stats.record_round(drafted=9, depth=4, tested=3, accepted=2, sources=("lookup", "draft"))
    stats.record_block(3, 3)  # a chain round: all three accepted
    assert (stats.drafted, stats.verified, stats.accepted, stats.target_calls) == (12, 6, 5, 2)
    assert stats.drafted_at == [2, 2, 2, 1] and stats.verified_at == [2, 2, 2, 0]
    assert stats.accepted_at == [2, 2, 1, 0] and stats.accepted_by_source == {"lookup": 1, "draft": 1}


def test_build_decoder_runs_trees_when_the_config_has_a_budget(target, close_draft):
    resolved = [ResolvedModel("x", None, model, None, "", None) for model in (target, close_draft)]
    decoder = build_decoder(*resolved, DecodeConfig(tree_budget=8, tree_branching=3, lookup_min_ngram=2))
    assert isinstance(decoder.drafter, TreeDrafter) and decoder.drafter.budget == 8
    assert decoder.drafter.name == ("tree(budget=8): lookup(n=2..3, branches=3)+suffix(request only, no index)"
                                    "+draft(branching=3, min_confidence=0.4, rerank)")
    assert isinstance(build_decoder(*resolved, DecodeConfig()).drafter, TreeDrafter)  # trees are the default
    chains = DecodeConfig().chain_rounds()
    assert not chains.tree_rounds and not isinstance(build_decoder(*resolved, chains).drafter, TreeDrafter)
    assert DecodeConfig(tree_budget_schedule=None) == chains.model_copy(update={"suffix": True})
    with pytest.raises(ValueError):
        DecodeConfig(tree_budget=-1)
    with pytest.raises(ValueError):
        DecodeConfig(tree_branching=0)


def test_breadth_first_tree():
    tree = TokenTree.breadth_first(6, 128)
    assert len(tree) == 6 and tree.parents == [ROOT, ROOT, 0, 0, 1, 1] and tree.depths == [1, 1, 2, 2, 2, 2]
    assert TokenTree.breadth_first(64, 128).depth == 6

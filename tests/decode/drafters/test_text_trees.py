"""Suffix decoding as a tree source: the nodes `SuffixTree` adds (by hand), target-greedy identity with suffix nodes
accepted beside lookup and the draft model's tree, and the `decode.drafters.suffix` switch through `build_decoder`."""
import pytest
import torch

from decode.drafters.suffix import SuffixDrafter, SuffixIndex
from decode.drafters.text_trees import SuffixTree
from decode.drafters.tree_drafter import TreeDrafter, make_tree_drafter
from decode.factory import build_decoder, model_decoder
from decode.token_tree import ROOT, TokenTree
from pipeline.config import DecodeConfig
from pipeline.sources import SUFFIX_INDEX_FILE, ResolvedModel
from tests.decode.tiny import greedy_reference

# After "1 2 3": 4 twice, 5 once; after "1 2 3 4": 6 twice; after "1 2 3 4 6": 8 once, 9 once.
SEQUENCES = [[1, 2, 3, 4, 6, 8], [1, 2, 3, 5, 7], [1, 2, 3, 4, 6, 9]]


def test_suffix_tree_adds_the_candidates_within_budget_and_depth():
    source = SuffixTree(SuffixDrafter(SuffixIndex(SEQUENCES), 10))
    assert source.name == "suffix(index of 3 sequences)" and source.context is None
    state = source.start([1, 2, 3])
    # the 3-token match allows 3 nodes: 4 (2/3), then its child 6 (2/3 * 2/2) before 5 (1/3); 4 is already lookup's
    # node, so the suffix's 4 merges into it (no second trial: a repeated deterministic candidate is dropped)
    tree = TokenTree()
    tree.add(ROOT, 4, "lookup")
    assert source.grow(state, tree, [1, 2, 3], 3, 2, None, None) == 0
    assert (tree.tokens, tree.parents, tree.sources) == ([4, 6, 5], [ROOT, 0, ROOT], ["lookup", "suffix", "suffix"])
    assert [t.node for t in tree.trials(ROOT)] == [0, 2] and all(t.q is None for t in tree.trials(ROOT))
    # one level: the budget goes to the first level's 4 and 5; no budget or depth: nothing
    tree = TokenTree()
    source.grow(state, tree, [1, 2, 3], 3, 1, None, None)
    assert (tree.tokens, tree.parents) == ([4, 5], [ROOT, ROOT])
    for budget, depth in ((0, 3), (3, 0)):
        tree = TokenTree()
        source.grow(state, tree, [1, 2, 3], budget, depth, None, None)
        assert len(tree) == 0
    # commit brings the request's tokens up to date; "1 2 3 4 6" (5 tokens) is followed by 8 or 9, 1/2 each
    source.commit(state, [1, 2, 3, 4, 6])
    assert state.length == 5
    tree = TokenTree()
    source.grow(state, tree, [1, 2, 3, 4, 6], 8, 3, None, None)
    assert (tree.tokens, tree.parents) == ([8, 9], [ROOT, ROOT])


def test_without_an_index_the_request_alone_is_searched():
    source = SuffixTree(SuffixDrafter(None, 10))
    assert source.name == "suffix(request only, no index)"
    tree = TokenTree()
    seq = [5, 6, 7, 1, 5, 6]  # "5 6" occurred before, followed by 7 then 1
    source.grow(source.start(seq), tree, seq, 4, 4, None, None)
    assert (tree.tokens, tree.parents) == ([7, 1], [ROOT, 0])


@pytest.fixture(scope="module")
def greedy_case(target):
    """Prompts, the target's greedy outputs, and an index holding prompt + output of the first four (the test decodes
    the last four: two whose continuation the index holds, two it does not)."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (6,), generator=generator).tolist() for _ in range(6)]
    outputs = [greedy_reference(target, p, 24) for p in prompts]
    return prompts, outputs, SuffixIndex([p + o for p, o in zip(prompts[:4], outputs[:4])])


def decode_all(target, drafter, greedy_case, gamma: int) -> dict[str, int]:
    """Decode the last four prompts, asserting target-greedy output; returns the accepted tokens by source."""
    prompts, outputs, _ = greedy_case
    by_source: dict[str, int] = {}
    decoder = model_decoder(target, drafter, gamma)
    for prompt, output in zip(prompts[2:], outputs[2:]):
        result = decoder.generate(prompt, max_new_tokens=24)
        assert result.token_ids == output
        assert sum(result.stats.accepted_by_source.values()) == result.stats.accepted
        for source, n in result.stats.accepted_by_source.items():
            by_source[source] = by_source.get(source, 0) + n
    return by_source


@pytest.mark.parametrize("lookup_min_ngram", [None, 1])
@pytest.mark.parametrize("budget,branching,gamma", [(4, 1, 3), (8, 2, 5)])
def test_suffix_in_a_tree_gives_target_greedy_output(target, close_draft, random_draft, greedy_case, lookup_min_ngram,
                                                     budget, branching, gamma):
    for draft in (close_draft, random_draft):
        drafter = make_tree_drafter("decoder", target, draft, budget=budget, branching=branching,
                                    lookup_min_ngram=lookup_min_ngram, suffix=True, suffix_index=greedy_case[2])
        assert [s.name.split("(")[0] for s in drafter.sources] == ["lookup"] * (lookup_min_ngram is not None) + [
            "suffix", "draft"]
        assert decode_all(target, drafter, greedy_case, gamma)["suffix"] > 0


def test_suffix_with_lookup_alone_and_alone(target, greedy_case):
    drafter = make_tree_drafter("lookup", target, budget=6, suffix=True, suffix_index=greedy_case[2])
    assert drafter.name == "tree(budget=6): lookup(n=1..3, branches=2)+suffix(index of 4 sequences)"
    accepted = decode_all(target, drafter, greedy_case, 4)
    assert accepted["suffix"] > 0 and set(accepted) <= {"lookup", "suffix"}
    alone = TreeDrafter([SuffixTree(SuffixDrafter.for_model(target, greedy_case[2]))], budget=3)
    assert set(decode_all(target, alone, greedy_case, 5)) == {"suffix"}


def test_suffix_with_a_reduced_vocabulary_draft(target, reduced_draft, greedy_case):
    draft, token_ids = reduced_draft
    drafter = make_tree_drafter("decoder", target, draft, budget=6, draft_token_ids=token_ids, suffix=True,
                                suffix_index=greedy_case[2])
    assert decode_all(target, drafter, greedy_case, 4)["suffix"] > 0


def test_the_config_switch(target, close_draft, greedy_case, tmp_path):
    # on by default, read in tree rounds only; an index file without trees is refused
    assert DecodeConfig().suffix_decoding and not DecodeConfig(tree_budget_schedule=None).suffix_decoding
    with pytest.raises(ValueError, match="decode.suffix_index is read by suffix decoding in tree rounds"):
        DecodeConfig(tree_budget_schedule=None, suffix_index="index.json")
    decode = DecodeConfig(suffix=True, tree_budget=6, tree_branching=2, lookup_min_ngram=2, draft_min_confidence=None)
    target_model = ResolvedModel("t", tmp_path / "target", target, None, "", None)
    bare = ResolvedModel("d", tmp_path, close_draft, None, "", None)
    assert build_decoder(target_model, bare, decode).drafter.name == (
        "tree(budget=6): lookup(n=2..3, branches=2)+suffix(request only, no index)+draft(branching=2, rerank)")
    greedy_case[2].save(tmp_path / SUFFIX_INDEX_FILE)
    decoder = build_decoder(target_model, bare, decode)
    assert decoder.drafter.name == (
        "tree(budget=6): lookup(n=2..3, branches=2)+suffix(index of 4 sequences)+draft(branching=2, rerank)")
    prompts, outputs, _ = greedy_case
    result = decoder.generate(prompts[3], max_new_tokens=24)
    assert result.token_ids == outputs[3] and result.stats.accepted_by_source["suffix"] > 0
    # the draft model alone keeps its own acceptance; prompt lookup without a draft searches the request only
    assert build_decoder(target_model, bare, decode, kind="draft").drafter.name == ("tree(budget=6): "
                                                                                   "draft(branching=2, rerank)")
    assert build_decoder(target_model, None, decode, kind="lookup").drafter.name == (
        "tree(budget=6): lookup(n=2..3, branches=2)+suffix(request only, no index)")

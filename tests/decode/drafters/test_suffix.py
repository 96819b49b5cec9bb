"""Suffix decoding: the index, the candidates it grows (against hand counts and a brute-force search), persistence,
and that decoding with the suffix drafter is lossless (greedy and sampled)."""
import heapq
import random

import numpy as np
import pytest
import torch

from decode.drafters.suffix import (
    Candidates,
    RequestTokens,
    SuffixDrafter,
    SuffixIndex,
    SuffixSearch,
    load_suffix_index,
)
from decode.factory import model_decoder
from decode.sampling import Warp
from pipeline.sources import SUFFIX_INDEX_FILE
from tests.decode.tiny import greedy_reference, tiny_llama
from tests.lossless.test_drafts_and_families import check_first_two

SEQUENCES = [[1, 2, 3, 4], [1, 2, 3, 5], [9, 2, 3, 4, 6]]


def test_index_layout_and_occurrences():
    index = SuffixIndex(SEQUENCES)
    assert index.tokens.tolist() == [-1, 1, 2, 3, 4, -1, 1, 2, 3, 5, -1, 9, 2, 3, 4, 6, -1]
    assert index.after(3).tolist() == [4, 9, 14]  # 3 occurs at 3, 8 and 13
    assert index.after(9).tolist() == [12] and index.after(7).tolist() == [] and index.after(10**6).tolist() == []
    assert len(index) == 3 and index.num_tokens == 13 and index.sequences() == SEQUENCES
    assert SuffixIndex([]).after(1).tolist() == [] and SuffixIndex([]).sequences() == []
    with pytest.raises(ValueError, match=">= 0"):
        SuffixIndex([[1, -2]])


def test_request_tokens_skip_the_last_position_and_follow_rollbacks():
    request = RequestTokens([7, 2, 3, 2])
    assert request.after(2).tolist() == [3]  # the 2 at position 2; the last position (4) is not an occurrence
    request.sync([7, 2, 3, 2, 8] + list(range(10, 200)))  # grows past its first buffer
    assert request.length == 195 and request.after(2).tolist() == [3, 5]
    request.truncate(3)
    assert request.length == 3 and request.tokens[1:6].tolist() == [7, 2, 3, -1, -1]
    request.sync([7, 2, 3, 4])
    assert request.tokens[1:6].tolist() == [7, 2, 3, 4, -1]


def test_candidates_by_hand():
    index, search = SuffixIndex(SEQUENCES), SuffixSearch()
    # "2 3" occurs 3 times: then 4 (twice) or 5; a 2-token match allows 2 candidates. After "2 3 4" the text ended
    # once and went on with 6 once: 6 scores 2/3 * 1/2, tied with 5, which was reached first.
    assert search.candidates(index, RequestTokens([7, 2, 3]), 8) == Candidates([4, 5], [-1, -1], [2 / 3, 1 / 3], 2)
    assert search.candidates(index, RequestTokens([7, 2, 3]), 8, tree=False) == Candidates(
        [4, 6], [-1, 0], [2 / 3, 1 / 3], 2)
    # "1 2 3" (3 tokens: budget 3) is followed by 4 or 5 once each, both of which end their sequences.
    assert search.candidates(index, RequestTokens([1, 2, 3]), 8) == Candidates([4, 5], [-1, -1], [0.5, 0.5], 3)
    # the budget caps the tree; min_token_prob cuts the 1/3 branches
    assert search.candidates(index, RequestTokens([7, 2, 3]), 1) == Candidates([4], [-1], [2 / 3], 2)
    strict = SuffixSearch(min_token_prob=0.4)
    assert strict.candidates(index, RequestTokens([7, 2, 3]), 8) == Candidates([4], [-1], [2 / 3], 2)
    # the request's own repetition: "5 6 7 5" occurred before, followed by "6 7 5"; nothing in the index matches
    assert search.candidates(index, RequestTokens([5, 6, 7, 5, 6, 7, 5]), 8) == Candidates(
        [6, 7, 5], [-1, 0, 1], [1.0, 1.0, 1.0], 4)
    assert search.candidates(None, RequestTokens([8, 8]), 8) == Candidates([8], [-1], [1.0], 1)
    assert search.candidates(index, RequestTokens([8]), 8) == Candidates()
    # max_spec_offset lets a 1-token match propose 3 tokens; max_depth bounds the match
    assert SuffixSearch(max_spec_offset=2).candidates(index, RequestTokens([9]), 8).tokens == [2, 3, 4]
    assert search.candidates(index, RequestTokens([9, 2]), 8) == Candidates([3, 4], [-1, 0], [1.0, 1.0], 2)
    assert SuffixSearch(max_depth=2).candidates(index, RequestTokens([9, 2]), 8) == Candidates([3], [-1], [1.0], 1)


def occurrences(stores: list[tuple[list[int], bool]], pattern: tuple, match_length: int) -> int:
    """Brute force: occurrences of `pattern` in the stores (a request's last position starts no match)."""
    total = 0
    for seq, request in stores:
        last = len(seq) - 1 if request else len(seq)
        total += sum(seq[j:j + len(pattern)] == list(pattern) and j + match_length <= last
                     for j in range(len(seq)))
    return total


def brute_force(stores, context: list[int], budget: int, search: SuffixSearch, tree: bool) -> Candidates:
    """The reference's algorithm spelled out: every match length, shortest first, from the counts of the stores."""
    best = Candidates()
    for m in range(1, min(len(context), search.max_depth - 1) + 1):
        match = tuple(context[-m:])
        if not occurrences(stores, match, m):
            break
        limit = search.budget(m, budget)
        out, heap, order = Candidates(match_length=m), [(-1.0, 0, (), -1)], 1
        while heap and len(out.tokens) < limit:
            minus_prob, _, path, node = heapq.heappop(heap)
            if path:
                out.tokens.append(path[-1])
                out.parents.append(node)
                out.scores.append(-minus_prob)
                node = len(out.tokens) - 1
            if len(out.tokens) == limit:
                continue
            parent = occurrences(stores, match + path, m)
            children = sorted((-occurrences(stores, match + path + (t,), m), t) for t in range(10))
            for minus_count, token in children if tree else children[:1]:
                prob = -minus_prob * -minus_count / parent
                if minus_count == 0 or prob < search.min_token_prob:
                    break
                heapq.heappush(heap, (-prob, order, path + (token,), node))
                order += 1
        if out.tokens and out.score >= best.score:
            best = out
    return best


@pytest.mark.parametrize("seed", range(6))
def test_candidates_equal_a_brute_force_search(seed):
    rng = random.Random(seed)
    sequences = [[rng.randrange(4 if seed % 2 else 10) for _ in range(rng.randint(0, 30))] for _ in range(8)]
    index = SuffixIndex(sequences)
    search = SuffixSearch(max_depth=8, max_spec_factor=rng.choice([0.5, 1.0, 2.0]),
                          min_token_prob=rng.choice([0.0, 0.1, 0.3]))
    for _ in range(20):
        context = [rng.randrange(4 if seed % 2 else 10) for _ in range(rng.randint(1, 12))]
        window = context[-(search.max_depth):]
        for tree in (True, False):
            ours = search.candidates(index, RequestTokens(context), 6, tree=tree)
            request = brute_force([(context, True)], window, 6, search, tree)
            from_index = brute_force([(s, False) for s in sequences], window, 6, search, tree)
            expected = request if request.score >= from_index.score else from_index
            assert ours.tokens == expected.tokens and ours.parents == expected.parents
            assert ours.match_length == expected.match_length
            np.testing.assert_allclose(ours.scores, expected.scores)


def test_save_load_and_the_draft_folder(tmp_path):
    assert load_suffix_index(tmp_path) is None  # a draft without the file has no suffix index
    SuffixIndex(SEQUENCES).save(tmp_path / SUFFIX_INDEX_FILE)
    loaded = load_suffix_index(tmp_path)
    assert loaded.sequences() == SEQUENCES and np.array_equal(loaded.order, SuffixIndex(SEQUENCES).order)
    (tmp_path / "other.json").write_text('{"format": "something else", "sequences": []}')
    with pytest.raises(ValueError, match="not a version 1"):
        SuffixIndex.load(tmp_path / "other.json")


def test_drafter_proposes_the_chain_with_one_hot_q():
    drafter = SuffixDrafter(SuffixIndex(SEQUENCES), 10)
    state = drafter.start([7, 2])
    drafts, q, forwards = drafter.propose(state, [7, 2, 3], 4, Warp(temperature=1.0), None)
    assert drafts.tolist() == [4, 6] and forwards == 0
    assert torch.equal(q, torch.nn.functional.one_hot(torch.tensor([4, 6]), 10).float())
    drafts, q, _ = drafter.propose(state, [7, 2, 3], 1, Warp(), None)
    assert drafts.tolist() == [4] and q is None
    assert drafter.candidates(state, [7, 2, 3], 8).tokens == [4, 5]
    drafter.rollback(state, 2)
    assert state.length == 2 and drafter.propose(state, [7, 2, 8], 4, Warp(), None)[0].tolist() == []


def test_greedy_equals_target_only_greedy(target):
    """An index of the target's own greedy outputs (from other prompts and these) must leave the output unchanged."""
    torch.manual_seed(0)
    prompts = [torch.randint(0, 128, (6,)).tolist() for _ in range(6)]
    outputs = [greedy_reference(target, p, 24) for p in prompts]
    index = SuffixIndex([p + o for p, o in zip(prompts[:4], outputs[:4])])
    decoder = model_decoder(target, SuffixDrafter.for_model(target, index), 5)
    accepted = 0
    for prompt, output in zip(prompts[2:], outputs[2:]):
        result = decoder.generate(prompt, max_new_tokens=24)
        assert result.token_ids == output
        assert result.stats.draft_calls == 0 and result.stats.accepted <= result.stats.drafted
        accepted += result.stats.accepted
    assert accepted > 0


VOCAB = 16
PROMPT = [3, 5, 7]
INDEX = [[3, 5, 7, 9, 11, 2]]  # the first block proposes "9 11": both draft positions and the bonus are exercised


def test_lossless_when_sampling():
    target = tiny_llama(10, vocab_size=VOCAB, init_range=0.15)
    drafter = SuffixDrafter.for_model(target, SuffixIndex(INDEX))
    assert drafter.propose(drafter.start(PROMPT), PROMPT, 2, Warp(temperature=1.0), None)[0].tolist() == [9, 11]
    stats = check_first_two(target, model_decoder(target, drafter, 2), PROMPT)
    assert 0 < sum(s.accepted for s in stats) < sum(s.verified for s in stats)

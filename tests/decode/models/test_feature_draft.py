"""The feature draft (decode.models.feature_draft): training's unrolled steps compute what decoding computes, the
target's lean forward hands over the same features as transformers', and decoding with it stays lossless."""
from __future__ import annotations

import pytest
import torch

from decode.acceptance import analytic_acceptance
from decode.drafters.suffix import SuffixIndex
from decode.drafters.tree_drafter import FeatureTree, make_tree_drafter
from decode.factory import model_decoder
from decode.models.feature_draft import FeatureDraft, FeatureDrafter, default_feature_layers, window_start
from decode.runtime.forward import ModelRunner, greedy_decode, target_features
from decode.sampling import Warp
from decode.step_costs import FeatureRounds, measure_costs
from decode.token_tree import ROOT, TokenTree
from tests.conftest import make_tiny_model
from tests.lossless.test_drafts_and_families import check_first_two

VOCAB = 40


def make_feature_draft(target, seed: int = 1, token_ids=None) -> FeatureDraft:
    torch.manual_seed(seed)
    draft = FeatureDraft(target.config, target.get_input_embeddings(), token_ids=token_ids)
    with torch.no_grad():  # a random head over small logits would be near uniform: give it some confidence
        draft.lm_head.weight.mul_(8)
    return draft.eval()


@pytest.fixture(scope="module")
def target():
    return make_tiny_model(VOCAB, seed=3, layers=4)


def test_default_layers_are_speculators_and_fit_shallow_models():
    assert default_feature_layers(30) == (2, 15, 27)
    assert default_feature_layers(7) == (2, 3, 4)
    assert default_feature_layers(4) == (1, 2, 3)
    assert default_feature_layers(2) == (0, 1, 1)


@torch.no_grad()
def test_lean_forward_hands_over_the_features_transformers_computes(target):
    layers = default_feature_layers(4)
    tokens = torch.tensor([1, 5, 9, 3, 7, 7, 2])
    hidden = target(input_ids=tokens[None], output_hidden_states=True).hidden_states
    expected = target_features(hidden, layers)[0]
    for lean in (True, False):
        runner = ModelRunner(target, lean)
        cache = runner.new_cache()
        logits_a, first = runner.forward_features(tokens[:4], cache, 0, layers)
        logits_b, rest = runner.forward_features(tokens[4:], cache, 4, layers)
        torch.testing.assert_close(torch.cat([first, rest]), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(torch.cat([logits_a, logits_b]), target(tokens[None]).logits[0], atol=1e-5,
                                   rtol=1e-5)


@torch.no_grad()
def test_unrolled_training_steps_equal_decoding_past_each_index(target):
    """Step j of `unroll` at index i is what decoding computes for the j-th token past index i, when the tokens fed
    in between are the sequence's own (training feeds the right tokens)."""
    draft = make_feature_draft(target)
    seq = torch.tensor([1, 5, 9, 3, 7, 7, 4, 12, 30, 2])
    features = target_features(target(input_ids=seq[None], output_hidden_states=True).hidden_states,
                               draft.feature_layers)
    steps = draft.unroll(features, seq[None], torch.ones(1, len(seq), dtype=torch.long), steps=3)
    for i in (0, 3, 5):
        cache = draft.new_cache()
        out = draft.step(draft.fuse(features[0, : i + 1]), seq[1 : i + 2], cache, 0, torch.arange(1, i + 2))[-1:]
        torch.testing.assert_close(out[0], steps[0][0, i], atol=1e-5, rtol=1e-5)
        for j in (1, 2):
            out = draft.step(out, seq[i + 1 + j][None], cache, i + j, torch.tensor([i + 1 + j]))
            torch.testing.assert_close(out[0], steps[j][0, i], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_unroll_ignores_padding_and_other_rows(target):
    draft = make_feature_draft(target)
    seq = torch.tensor([[1, 5, 9, 3, 7, 7], [1, 8, 4, 0, 0, 0]])
    mask = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0]])
    features = target_features(target(input_ids=seq, attention_mask=mask, output_hidden_states=True).hidden_states,
                               draft.feature_layers)
    both = draft.unroll(features, seq, mask, steps=2)
    alone = draft.unroll(features[1:, :3], seq[1:, :3], mask[1:, :3], steps=2)
    torch.testing.assert_close(both[0][1, :3], alone[0][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(both[1][1, :1], alone[1][0, :1], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_unroll_from_a_window_gives_the_full_unrolls_outputs_at_its_indices(target):
    """Training starts each row's unroll a few indices before its response (`window_start`): the indices it runs
    compute what the full unroll computes there, whatever the other rows' windows and padding."""
    draft = make_feature_draft(target)
    seq = torch.tensor([[1, 5, 9, 3, 7, 7, 4, 12], [1, 8, 4, 6, 2, 0, 0, 0]])
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    features = target_features(target(input_ids=seq, attention_mask=mask, output_hidden_states=True).hidden_states,
                               draft.feature_layers)
    full = draft.unroll(features, seq, mask, steps=3)
    first = torch.tensor([4, 1])
    windowed = draft.unroll(features, seq, mask, steps=3, first=first)
    assert [tuple(h.shape[:2]) for h in windowed] == [(2, 4)] * 3  # R: the longest row from its first, 8 - 4
    for full_j, windowed_j in zip(full, windowed, strict=True):
        torch.testing.assert_close(windowed_j[0, :4], full_j[0, 4:], atol=1e-5, rtol=1e-5)  # indices 4..7
        torch.testing.assert_close(windowed_j[1, :4], full_j[1, 1:5], atol=1e-5, rtol=1e-5)  # indices 1..4 (valid)


def test_the_window_starts_as_many_indices_before_the_first_scored_one_as_there_are_steps():
    loss_mask = torch.tensor([[False] * 6 + [True] * 2, [False, True, True, False, False, False, False, False],
                              [False] * 8])
    assert window_start(loss_mask, steps=3).tolist() == [3, 0, 0]


@torch.no_grad()
@pytest.mark.parametrize("lookup", [None, 2])
@pytest.mark.parametrize("reduced", [False, True])
def test_greedy_decoding_with_a_feature_draft_equals_the_target_alone(target, lookup, reduced):
    token_ids = torch.arange(0, VOCAB, 2) if reduced else None
    draft = make_feature_draft(target, token_ids=token_ids)
    decoder = model_decoder(target, draft, gamma=3, lookup_min_ngram=lookup, eos_token_ids=())
    runner = ModelRunner(target)
    for prompt in ([1, 5, 9, 3], [1, 7], [1]):
        result = decoder.generate(prompt, max_new_tokens=20)
        assert result.token_ids == greedy_decode(runner, prompt, 20)
        assert result.stats.new_tokens == 20


def test_sampling_with_a_feature_draft_keeps_the_targets_distribution():
    target = make_tiny_model(12, seed=4, layers=3, hidden=32)
    draft = make_feature_draft(target, seed=2, token_ids=torch.tensor([0, 2, 3, 5, 7, 8, 11]))
    stats = check_first_two(target, model_decoder(target, draft, gamma=2, eos_token_ids=()), [1, 4, 6])
    assert sum(s.accepted for s in stats) > 0  # the draft's proposals were tested, some accepted


def test_the_drafter_refuses_a_decoder_that_skips_a_target_pass(target):
    drafter = FeatureDrafter(make_feature_draft(target), VOCAB, torch.device("cpu"))
    state = drafter.start([1, 5, 9])
    with pytest.raises(RuntimeError, match="did not hand over"):
        drafter.propose(state, [1, 5, 9], 2, Warp(0.0, 0, 1.0), None)


@torch.no_grad()
def test_analytic_acceptance_of_a_feature_draft_is_its_first_draft_position(target):
    """α at response token t: Σ min(p, q) with q the draft's prediction from the target's features at t - 2 and
    token t - 1, as decoding proposes the first token of a round."""
    draft = make_feature_draft(target, token_ids=torch.arange(0, VOCAB, 2))
    seq, start = [1, 5, 9, 3, 7, 7, 4], 4
    got = analytic_acceptance(target, draft, [seq], [start]).per_position[0]
    hidden = target(input_ids=torch.tensor([seq]), output_hidden_states=True).hidden_states
    features = target_features(hidden, draft.feature_layers)[0]
    expected = []
    for t in range(start, len(seq)):
        p = target(input_ids=torch.tensor([seq[:t]])).logits[0, -1].softmax(-1)
        out = draft.step(draft.fuse(features[: t - 1]), torch.tensor(seq[1:t]), draft.new_cache(), 0,
                         torch.arange(1, t))[-1]
        q = torch.zeros(VOCAB).index_copy_(0, draft.token_ids, draft.logits(out).softmax(-1))
        expected.append(torch.minimum(p, q).sum().item())
    assert got == pytest.approx(expected, abs=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
def test_a_tree_pass_hands_over_each_nodes_features_as_feeding_its_path_would(target, lean):
    layers = default_feature_layers(4)
    prefix = [1, 5, 9, 3, 7]
    tree = TokenTree()
    a = tree.add(ROOT, 7, "s")
    tree.add(a, 2, "s")
    tree.add(ROOT, 11, "s")
    runner = ModelRunner(target, lean)
    cache, start = runner.new_cache(), len(prefix) - 1
    runner.forward(torch.tensor(prefix[:-1]), cache, 0, True)
    logits, features = runner.forward_tree_features(torch.tensor(prefix[-1:] + tree.tokens), cache, start,
                                                    start + torch.tensor([0, *tree.depths]), tree.attention_mask(),
                                                    layers)
    for node in (ROOT, *range(len(tree))):
        path = prefix + [tree.tokens[i] for i in tree.path(node)] if node != ROOT else prefix
        out = target(input_ids=torch.tensor([path]), output_hidden_states=True)
        torch.testing.assert_close(features[node + 1], target_features(out.hidden_states, layers)[0, -1], atol=1e-5,
                                   rtol=1e-5)
        torch.testing.assert_close(logits[node + 1], out.logits[0, -1], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_a_feature_tree_node_sees_what_decoding_its_path_as_a_chain_sees(target):
    """Every node's output hidden state in a grown feature tree equals the chain drafter's after the same tokens."""
    drafter_tree = make_tree_drafter("draft", target, make_feature_draft(target), budget=7, branching=2,
                                     draft_rerank=False)
    source = drafter_tree.sources[0]
    assert isinstance(source, FeatureTree) and drafter_tree.feature_layers == default_feature_layers(4)
    seq = [1, 5, 9, 3, 7, 7]
    features = target_features(target(input_ids=torch.tensor([seq]), output_hidden_states=True).hidden_states,
                               source.feature_layers)[0, :-1]
    state = source.start(seq)
    source.observe(state, features)
    tree = TokenTree()
    calls = source.grow(state, tree, seq, 7, 3, Warp(0.0, 0, 1.0), None)
    assert len(tree) == 6 and tree.depth == 3 and calls == 3  # 2 best per level (a per-level beam)
    chain = source.drafter
    for node in range(4):  # the nodes of the levels that were fed (the last level never is)
        reference = chain.start(seq)
        chain.observe(reference, features)
        out = chain.feed_pending(reference, seq)
        for i, token in enumerate(tree.tokens[n] for n in tree.path(node)):
            out = chain.model.step(out, torch.tensor([token]), reference.cache, len(seq) - 1 + i,
                                   torch.tensor([len(seq) + i]))
        torch.testing.assert_close(state.outputs[1 + node], out[0], atol=1e-6, rtol=1e-6)
    source.commit(state, seq + [tree.tokens[0], 4])
    assert state.features.cache.length == len(seq) - 1 and state.outputs is None


@torch.no_grad()
@pytest.mark.parametrize("reduced", [False, True])
def test_greedy_decoding_with_a_feature_draft_tree_equals_the_target_alone(target, reduced):
    token_ids = torch.arange(0, VOCAB, 2) if reduced else None
    draft = make_feature_draft(target, token_ids=token_ids)
    runner = ModelRunner(target)
    index = SuffixIndex([[5, 9, 3, 7, 30, 2], [9, 3, 7, 30]])
    drafters = [make_tree_drafter("draft", target, draft, budget=6, branching=3),
                make_tree_drafter("decoder", target, draft, budget_schedule=[[8, 3], [64, 8]], branching=2,
                                  lookup_min_ngram=1, suffix=True, suffix_index=index)]
    for drafter in drafters:
        decoder = model_decoder(target, drafter, 4, eos_token_ids=())
        for prompt in ([1, 5, 9, 3], [1, 7], [1]):
            result = decoder.generate(prompt, max_new_tokens=20)
            assert result.token_ids == greedy_decode(runner, prompt, 20)
            assert sum(result.stats.accepted_by_source.values()) == result.stats.accepted
    assert result.stats.draft_calls > 0


def test_sampling_with_a_feature_draft_tree_keeps_the_targets_distribution():
    target = make_tiny_model(12, seed=4, layers=3, hidden=32)
    draft = make_feature_draft(target, seed=2, token_ids=torch.tensor([0, 2, 3, 5, 7, 8, 11]))
    decoder = model_decoder(target, make_tree_drafter("decoder", target, draft, budget=5, branching=2,
                                                           lookup_min_ngram=1), 2, eos_token_ids=())
    stats = check_first_two(target, decoder, [1, 4, 6, 4])
    assert sum(s.accepted_by_source.get("draft", 0) for s in stats) > 0  # the draft's siblings were accepted


@torch.no_grad()
def test_the_cost_model_times_a_feature_drafter_as_the_decoder_feeds_it(target):
    """`FeatureRounds`: each timed round drafts what the drafter drafts after the decoder handed over every feature of
    the sequence, again after each rollback; `measure_costs` prices its rounds."""
    drafter = FeatureDrafter(make_feature_draft(target), VOCAB, torch.device("cpu"))
    tokens = [int(t) for t in torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(0))]
    rounds, warp, seq = FeatureRounds(drafter, target, tokens), Warp(0.0, 0, 1.0), tokens[:21]
    runner = ModelRunner(target)
    _, features = runner.forward_features(torch.tensor(tokens), runner.new_cache(), 0, drafter.feature_layers)
    reference = drafter.start(seq)
    drafter.observe(reference, features[:20])
    expected = drafter.propose(reference, seq, 4, warp, None)[0]
    state = rounds.start(seq)
    for _ in range(3):
        assert torch.equal(rounds.propose(state, seq, 4, warp, None)[0], expected)
        rounds.rollback(state, 20)
    costs = measure_costs(target, {"feature": drafter}, tokens, [8, 20], [1, 3], reps=1, prefill_reps=1)
    assert all(len(c) == 2 and min(c) > 0 for c in costs["drafts"]["feature"]["c"].values())

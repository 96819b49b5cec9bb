"""Node budgets from measured costs: rank acceptance, Sequoia's best trees, the predicted tokens/s per budget and the
schedule the sweep recommends, the tree verify timing, and decoding with a budget schedule."""
from __future__ import annotations

import itertools

import pytest
import torch

from decode.acceptance import analytic_acceptance, draft_rank
from decode.drafters.tree_drafter import TreeDrafter, make_tree_drafter
from decode.factory import build_decoder, model_decoder
from decode.runtime.forward import ModelRunner, greedy_decode
from decode.step_costs import measure_costs
from decode.token_tree import ROOT
from decode.tree_budget_prediction import (
    best_trees,
    context_schedule,
    draft_cost,
    predict_tree_budgets,
    rank_acceptance,
    recommend_tree_budget,
    tree_shape,
)
from pipeline.config import DecodeConfig
from pipeline.sources import ResolvedModel
from tests.decode.tiny import greedy_reference


def test_rank_acceptance_counts_every_position():
    # ranks 1, 1, 1, 2, 3 and one token outside the draft's vocabulary (0)
    assert rank_acceptance([[1, 2, 1, 0], [3, 1]], 4) == pytest.approx([3 / 6, 1 / 6, 1 / 6, 0.0])
    with pytest.raises(ValueError, match="no ranked positions"):
        rank_acceptance([[], []], 2)


def tau_of(parents: list[int], p: list[float]) -> float:
    """1 + Σ over nodes of the product of p[rank] along the path, a node's rank being its place among its siblings."""
    value, seen = [], {}
    for parent in parents:
        rank = seen[parent] = seen.get(parent, -1) + 1
        value.append((1.0 if parent == ROOT else value[parent]) * (p[rank] if rank < len(p) else 0.0))
    return 1 + sum(value)


def test_best_trees_by_hand():
    trees = best_trees([0.6, 0.2], 3, 3)
    assert trees.tau(1, 1) == pytest.approx(1.6)
    assert trees.tau(3, 1) == pytest.approx(1.8)  # ranks 1, 2 and a rank 3 the draft never gets right,
    assert trees.parents(3, 1) == [ROOT, ROOT]  # which the shape leaves out
    assert trees.tau(2, 2) == pytest.approx(1 + 0.6 + 0.36)  # the chain beats two siblings
    # 3 nodes, 2 levels: both first-level ranks and the top child of rank 1: 0.6 + 0.2 + 0.6·0.6
    assert trees.tau(3, 2) == pytest.approx(2.16) and trees.parents(3, 2) == [ROOT, 0, ROOT]
    assert trees.tau(3, 3) == pytest.approx(1 + 0.6 + 0.36 + 0.216) and trees.parents(3, 3) == [ROOT, 0, 1]
    # a better second choice cannot skip the first: rank 2 needs rank 1 beside it
    skewed = best_trees([0.1, 0.5], 3, 2)
    assert skewed.tau(2, 1) == pytest.approx(1.6)
    assert skewed.tau(3, 2) == pytest.approx(1 + 0.1 + 0.5 + 0.5 * 0.1) and skewed.parents(3, 2) == [ROOT, ROOT, 1]
    with pytest.raises(ValueError, match="sum to at most 1"):
        best_trees([0.7, 0.5], 3, 2)


def test_best_trees_are_the_most_likely_nodes_when_acceptance_falls_with_rank():
    """With p non-increasing the best n nodes are the n most likely ones of the unbounded tree (each is no likelier
    than its parent or its earlier sibling, so they form a tree)."""
    p, max_nodes, max_depth = [0.45, 0.25, 0.1, 0.05], 7, 3
    trees = best_trees(p, max_nodes, max_depth)
    for depth in range(1, max_depth + 1):
        values = sorted((float(torch.tensor([p[r] for r in path]).prod())
                         for d in range(1, depth + 1) for path in itertools.product(range(len(p)), repeat=d)),
                        reverse=True)
        for n in range(1, max_nodes + 1):
            assert trees.tau(n, depth) == pytest.approx(1 + sum(values[:n]))
            shape = trees.parents(n, depth)
            assert len(shape) == min(n, len(values)) and tree_shape(shape)[0] <= depth  # every node can be accepted
            assert tau_of(shape, p) == pytest.approx(trees.tau(n, depth))


def test_best_trees_against_every_tree_when_acceptance_does_not_fall_with_rank():
    """Every tree of up to 3 ranks per node and 2 levels (node sets closed under parent and earlier sibling)."""
    p = [0.1, 0.4, 0.3]
    paths = [(r,) for r in range(3)] + list(itertools.product(range(3), repeat=2))
    best = {}
    for mask in range(1 << len(paths)):
        chosen = {path for i, path in enumerate(paths) if mask >> i & 1}
        if all(path[:-1] in chosen | {()} and (path[-1] == 0 or path[:-1] + (path[-1] - 1,) in chosen)
               for path in chosen):
            value = sum(float(torch.tensor([p[r] for r in path]).prod()) for path in chosen)
            best[len(chosen)] = max(best.get(len(chosen), 0.0), value)
    trees = best_trees(p, 4, 2)
    for n in range(1, 5):
        assert trees.tau(n, 2) == pytest.approx(1 + best[n])
        assert tau_of(trees.parents(n, 2), p) == pytest.approx(trees.tau(n, 2))


def test_tree_shape():
    assert tree_shape([ROOT, 0, ROOT, 0, 1, 2]) == (3, 3)
    assert tree_shape([]) == (0, 0)


def hand_costs() -> dict:
    """Two contexts; every ratio is to that context's target step."""
    return {"contexts": [100, 1000],
            "target": {"step_s": [0.01, 0.02], "v": {"2": [1.0, 1.0], "3": [1.1, 1.2]},
                       "v_tree": {"2": [1.05, 1.1], "4": [1.1, 1.5]}},
            "drafts": {"d": {"c": {"1": [0.1, 0.1], "2": [0.1, 0.1]}}}}


def test_draft_cost_interpolates_between_measured_gammas():
    costs = {"drafts": {"d": {"c": {"1": [0.1], "3": [0.3]}}}}
    assert draft_cost(costs, "d", 0, 2) == pytest.approx(2 * 0.2)
    assert draft_cost(costs, "d", 0, 5) == pytest.approx(5 * 0.3)


def test_predicted_tokens_per_second_and_the_recommended_budget():
    """p = (0.5, 0.3): τ_1(2) = 1.8, τ_2(2) = 1.8 (two siblings), τ_1(4) = 1.8, τ_2(4) = 1 + .5 + .3 + .25 + .15."""
    rows, chains = predict_tree_budgets(hand_costs(), "d", [0.5, 0.3], [2, 4], max_depth=2)
    got = {(r["context"], r["budget"]): r for r in rows}
    # context 100: B=2 at one level 1.8 / (0.1 + 1.05); B=4 at two levels 2.2 / (0.2 + 1.1)
    assert got[(100, 2)]["predicted_speedup"] == pytest.approx(1.8 / 1.15)
    assert (got[(100, 2)]["depth"], got[(100, 2)]["width"]) == (1, 2)
    assert got[(100, 4)]["predicted_speedup"] == pytest.approx(2.2 / 1.3)
    assert got[(100, 4)]["predicted_tokens_per_s"] == pytest.approx(2.2 / 1.3 / 0.01)
    assert (got[(100, 4)]["tau"], got[(100, 4)]["depth"], got[(100, 4)]["width"]) == (pytest.approx(2.2), 2, 2)
    assert got[(100, 4)]["draft_cost"] == pytest.approx(0.2) and got[(100, 4)]["v_tree"] == 1.1
    # context 1000: width costs more; B=2: 1.8 / 1.2; B=4: max(1.8 / 1.6, 2.2 / 1.7)
    assert got[(1000, 2)]["predicted_tokens_per_s"] == pytest.approx(1.8 / 1.2 / 0.02)
    assert got[(1000, 4)]["predicted_speedup"] == pytest.approx(2.2 / 1.7)
    # chains under the same model: γ=1 gives 1.5 / 1.1 at both contexts (γ=2: 1.75 / 1.3 and 1.75 / 1.4)
    assert [(c["gamma"], c["predicted_speedup"]) for c in chains] == [(1, pytest.approx(1.5 / 1.1))] * 2
    assert chains[1]["predicted_tokens_per_s"] == pytest.approx(1.5 / 1.1 / 0.02)

    worse, _ = predict_tree_budgets(hand_costs() | {"drafts": {"e": {"c": {"1": [0.5, 0.5]}}}}, "e", [0.5, 0.3],
                                    [2, 4], max_depth=2)
    recommendation = recommend_tree_budget(rows + worse, [100, 1000])
    assert recommendation["tree_draft"] == "d"
    assert recommendation["tree_budget_schedule"] == [[550, 4], [1000, 2]]
    assert recommendation["tree_mean_predicted_speedup"]["d"] == pytest.approx((2.2 / 1.3 + 1.8 / 1.2) / 2)
    assert recommendation["tree_shapes"] == [{"context": 100, "budget": 4, "nodes": 4, "depth": 2, "width": 2},
                                             {"context": 1000, "budget": 2, "nodes": 2, "depth": 1, "width": 2}]


def test_context_schedule_merges_equal_neighbours():
    assert context_schedule([512, 128, 2048, 1024], {128: 8, 512: 8, 1024: 4, 2048: 2}.get) == [
        [768, 8], [1536, 4], [2048, 2]]


def test_draft_rank_places_target_ids_in_the_draft_order():
    probs = torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]])
    # full vocabulary: id 2 is second at the first position, id 0 first at the second
    assert draft_rank(probs, torch.tensor([2, 0]), None).tolist() == [2, 1]
    # a reduced head over target ids 2, 5, 7: 7 is column 2 (second), 4 is outside (0), 5 is column 1 (third)
    assert draft_rank(probs, torch.tensor([7, 4]), torch.tensor([2, 5, 7])).tolist() == [2, 0]
    assert draft_rank(probs, torch.tensor([5, 5]), torch.tensor([2, 5, 7])).tolist() == [1, 3]


def test_greedy_ranks_place_the_target_token_in_the_draft_order(target, close_draft, reduced_draft):
    prompt = [5, 9, 2, 77, 3]
    sequence = prompt + greedy_decode(ModelRunner(target), prompt, 12)
    result = analytic_acceptance(target, close_draft, [sequence], [len(prompt)], temperature=0.0, greedy_ranks=True)
    ranks = result.ranks[0]
    assert len(ranks) == 12 and [r == 1 for r in ranks] == [a == 1.0 for a in result.per_position[0]]
    with torch.no_grad():
        q = close_draft(torch.tensor([sequence])).logits[0, len(prompt) - 1 : -1].float().softmax(-1)
    order = q.argsort(-1, descending=True).tolist()
    assert ranks == [order[t].index(token) + 1 for t, token in enumerate(sequence[len(prompt):])]
    draft, token_ids = reduced_draft  # even ids only: odd target tokens are outside the draft's vocabulary
    reduced = analytic_acceptance(target, draft, [sequence], [len(prompt)], temperature=0.0, draft_token_ids=token_ids,
                                  greedy_ranks=True).ranks[0]
    assert [r == 0 for r in reduced] == [t % 2 == 1 for t in sequence[len(prompt):]]
    assert all(1 <= r <= len(token_ids) for r in reduced if r)
    assert analytic_acceptance(target, close_draft, [sequence], [len(prompt)], temperature=0.0).ranks is None


def test_measure_costs_times_the_tree_verify_per_budget(target):
    tokens = list(range(3, 60))
    costs = measure_costs(target, {}, tokens, [8, 24], [1], reps=1, prefill_reps=1, tree_budgets=[2, 8])
    for key in ("v_tree", "tree_verify_s"):
        assert set(costs["target"][key]) == {"2", "8"}
        assert all(len(values) == 2 and min(values) > 0 for values in costs["target"][key].values())
    assert measure_costs(target, {}, tokens, [8], [1], reps=1, prefill_reps=1)["target"]["v_tree"] == {}


def test_decoding_with_a_budget_schedule_stays_target_greedy(target, close_draft):
    prompt = [5, 9, 2, 77, 3, 5, 9]
    bound = len(prompt) + 12
    drafter = make_tree_drafter("draft", target, close_draft, budget_schedule=[(bound, 2), (500, 8)], branching=3)
    assert drafter.budget == 8 and [drafter.budget_at(n) for n in (1, bound, bound + 1, 9999)] == [2, 2, 8, 8]
    rounds = []
    grow = drafter.grow

    def spy(states, seq, depth, warp, generator):
        tree, calls = grow(states, seq, depth, warp, generator)
        rounds.append((len(seq), len(tree)))
        return tree, calls

    drafter.grow = spy
    result = model_decoder(target, drafter, 4).generate(prompt, max_new_tokens=40)
    assert result.token_ids == greedy_reference(target, prompt, 40)
    assert all(nodes <= 2 for length, nodes in rounds if length <= bound)
    assert max(nodes for length, nodes in rounds if length > bound) > 2


def test_the_config_schedule_builds_a_scheduled_tree_drafter(target, close_draft):
    resolved = [ResolvedModel("x", None, model, None, "", None) for model in (target, close_draft)]
    decode = DecodeConfig(tree_budget_schedule=[[16, 2], [64, 6]], tree_branching=3)
    decoder = build_decoder(*resolved, decode)
    assert isinstance(decoder.drafter, TreeDrafter) and decoder.drafter.schedule.entries == ((16, 2), (64, 6))
    assert decoder.drafter.name.startswith("tree(budget_schedule=[[16, 2], [64, 6]]): lookup")
    prompt = [5, 9, 2, 77, 3, 5, 9]
    assert decoder.generate(prompt, max_new_tokens=30).token_ids == greedy_reference(target, prompt, 30)
    # a fixed budget replaces the schedule (the default has one): what runs is what the config records
    assert DecodeConfig(tree_budget=4, tree_budget_schedule=[[16, 2]]).tree_budget_schedule is None
    for bad in ([], [[16, 0]], [[64, 2], [16, 4]]):
        with pytest.raises(ValueError, match="tree_budget_schedule must be"):
            build_decoder(*resolved, DecodeConfig(tree_budget_schedule=bad))
    with pytest.raises(ValueError, match="either a budget >= 1 or a schedule"):
        TreeDrafter(decoder.drafter.sources, budget=4, schedule=[(16, 2)])

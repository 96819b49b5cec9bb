"""`tree_budget_schedule: auto`: the node budget by context picked from this machine's measured costs and the draft's
stored rank acceptance, measured once and cached, the built-in schedule where either is missing."""
from __future__ import annotations

import json

import pytest

import decode.tree_budget_measured as auto
from decode.drafters.protocol import DRAFT
from decode.drafters.suffix import SuffixIndex
from decode.factory import build_decoder, tree_drafters
from decode.runtime import machine_choice
from decode.tree_budget_prediction import TREE_BUDGETS, load_rank_acceptance, save_rank_acceptance
from pipeline import draftops_home
from pipeline.config import DEFAULT_TREE_BUDGET_SCHEDULE, DecodeConfig, DraftopsConfig
from pipeline.sources import TREE_ACCEPTANCE_FILE, ResolvedModel
from tests.decode.tiny import greedy_reference

P = [0.5, 0.2, 0.1, 0.05]  # the draft's rank acceptances p_1..p_4
NO_REPLAY = ("built-in schedule: no draft model, and no suffix index to replay prompt lookup's and suffix decoding's "
             "trees on")
TEXT = list(range(1, 21))  # a response with no repeats in itself: suffix decoding finds it in the index alone


@pytest.fixture
def models(target, close_draft, tmp_path):
    """(target, draft) as resolved models; the draft's folder carries P."""
    save_rank_acceptance(tmp_path, P, positions=400)
    return (ResolvedModel("target", None, target, None, "target-fp", None),
            ResolvedModel("draft", tmp_path, close_draft, None, "draft-fp", None))


def budget_of(target, draft, trees, **options) -> auto.BudgetChoice:
    """The budget schedule `choose_trees` gives trees grown by `draft` alone, or by `trees` alone (draft None)."""
    return auto.choose_trees(target, draft, trees, draft_kind=DRAFT, **options).budget


def test_rank_acceptance_file_round_trip(tmp_path):
    save_rank_acceptance(tmp_path, P, positions=400)
    assert json.loads((tmp_path / TREE_ACCEPTANCE_FILE).read_text()) == {"rank_acceptance": P, "positions": 400}
    assert load_rank_acceptance(tmp_path) == P
    assert load_rank_acceptance(tmp_path / "none") is None
    for bad in ("{", '{"rank_acceptance": [0.7, 0.6]}', '{"rank_acceptance": []}', '{"p": [0.5]}'):
        (tmp_path / TREE_ACCEPTANCE_FILE).write_text(bad)
        assert load_rank_acceptance(tmp_path) is None


def flat_costs(v_tree) -> dict:
    """Costs at context 128 whose tree verify costs v_tree(B) target steps, a draft level 0.05."""
    return {"contexts": [128],
            "target": {"step_s": [0.02], "v": {str(n): [1.0 + 0.02 * n] for n in range(2, 7)},
                       "v_tree": {str(b): [v_tree(b)] for b in TREE_BUDGETS}},
            "drafts": {"draft": {"c": {"1": [0.05], "5": [0.05]}}}}


@pytest.mark.parametrize(("v_tree", "budget"), [
    (lambda b: 1.0 + 0.005 * b, 32),  # verifying is nearly free in width: a wide tree
    (lambda b: 1.0 + 0.2 * b, 2),  # every node costs a fifth of a step: two nodes
])
def test_the_budget_follows_the_measured_cost_curve(models, monkeypatch, v_tree, budget):
    """With P, τ / (draft levels + v_tree) at the best depth: nearly flat costs: B=32 3.03 / 1.31 beats B=16
    2.77 / 1.23 and B=64 3.41 / 1.52; steep: B=2 1.70 / 1.45 beats B=3 1.95 / 1.70 and B=4 2.05 / 1.90."""
    monkeypatch.setattr(auto, "measure_costs", lambda *a, **k: flat_costs(v_tree))
    choice = budget_of(*models, None, max_depth=5, log=lambda line: None)
    assert choice == auto.BudgetChoice([(128, budget)], "measured on this machine")


def test_measured_once_then_cached_per_draft(models, monkeypatch, close_draft):
    monkeypatch.setattr(machine_choice, "machine_busy", lambda: None)  # (tests may run beside other work)
    lines = []
    first = budget_of(*models, None, max_depth=5, reps=1, log=lines.append)
    assert len(lines) == 1 and "timing the target's tree verify of 2-64 nodes" in lines[0]
    assert first.source == "measured on this machine"
    (budget,) = {b for _, b in first.schedule}  # one context fits the tiny target's 512 positions
    assert first.schedule == [(128, budget)] and budget in TREE_BUDGETS
    (cached,) = (draftops_home() / "machine_choice" / auto.COSTS).glob("*.json")
    assert json.loads(cached.read_text())["scope"]["contexts"] == [128]

    monkeypatch.setattr(auto, "measure_costs", lambda *a, **k: pytest.fail("measured again"))
    assert budget_of(*models, None, max_depth=5, log=lines.append) == first and len(lines) == 1
    other = ResolvedModel("other", models[1].path, close_draft, None, "other-fp", None)
    monkeypatch.setattr(auto, "measure_costs", lambda *a, **k: flat_costs(lambda b: 1.0 + 0.2 * b))
    assert budget_of(models[0], other, None, max_depth=5, log=lines.append).schedule == [(128, 2)]
    assert len(lines) == 2 and len(list(cached.parent.glob("*.json"))) == 2


def test_costs_timed_on_a_busy_machine_are_not_cached(models, monkeypatch):
    monkeypatch.setattr(auto, "measure_costs", lambda *a, **k: flat_costs(lambda b: 1.0 + 0.2 * b))
    monkeypatch.setattr(machine_choice, "machine_busy", lambda: "load 6.0 on 2 CPUs")
    lines = []
    with pytest.warns(machine_choice.BusyMachineWarning, match=r"tree_costs: timed on a busy machine \(load 6.0 on 2 "
                                                               r"CPUs\); used by this process and not cached"):
        assert budget_of(*models, None, max_depth=5, log=lines.append).schedule == [(128, 2)]
    assert not (draftops_home() / "machine_choice" / auto.COSTS).exists()
    # this process's later decoders use them: no second timing
    monkeypatch.setattr(auto, "measure_costs", lambda *a, **k: pytest.fail("measured again"))
    assert budget_of(*models, None, max_depth=5, log=lines.append).schedule == [(128, 2)]


def test_without_a_rank_acceptance_the_built_in_schedule_stands(models, target, close_draft, tmp_path):
    built_in = [tuple(e) for e in DEFAULT_TREE_BUDGET_SCHEDULE]
    (tmp_path / TREE_ACCEPTANCE_FILE).unlink()
    choice = budget_of(*models, None, max_depth=5)
    assert choice.schedule == built_in
    assert choice.source == ("built-in schedule: draft carries no rank acceptance (distilled before draftops "
                             "stored it)")
    assert budget_of(models[0], None, None, max_depth=5).source == NO_REPLAY


def test_the_decoder_runs_the_auto_schedule(models, monkeypatch, target):
    monkeypatch.setattr(auto, "measure_costs", lambda *a, **k: flat_costs(lambda b: 1.0 + 0.2 * b))
    decode = DecodeConfig()
    assert decode.tree_budget_schedule == "auto" and DraftopsConfig().decode.tree_budget_schedule == "auto"
    decoder = build_decoder(*models, decode)
    assert decoder.drafter.schedule.entries == ((128, 2),)
    prompt = [5, 9, 2, 77, 3, 5, 9]
    assert decoder.generate(prompt, max_new_tokens=30).token_ids == greedy_reference(target, prompt, 30)
    # prompt lookup and suffix decoding alone, with no suffix index to replay them on: the built-in schedule
    assert tree_drafters(decode, *models, kind="suffix").budget.source == NO_REPLAY
    assert tree_drafters(decode.chain_rounds(), *models) is None
    assert tree_drafters(DecodeConfig(tree_budget_schedule=[[16, 2]]), *models).budget == auto.BudgetChoice(
        [(16, 2)], "configured")
    with pytest.raises(ValueError, match="tree_budget_schedule"):
        DecodeConfig(tree_budget_schedule="wide")


def test_a_feature_draft_is_timed_with_the_targets_features(tmp_path, monkeypatch):
    from tests.conftest import make_tiny_model
    from tests.decode.models.test_feature_draft import VOCAB, make_feature_draft

    monkeypatch.setattr(machine_choice, "machine_busy", lambda: None)
    target = make_tiny_model(VOCAB, seed=3, layers=4)
    save_rank_acceptance(tmp_path, P, positions=400)
    feature = ResolvedModel("f", tmp_path, make_feature_draft(target), None, "f-fp", None)
    choice = budget_of(ResolvedModel("t", None, target, None, "t-fp", None), feature, None, max_depth=3, reps=1,
                       log=lambda line: None)
    assert choice.source == "measured on this machine" and [m for m, _ in choice.schedule] == [128]


def test_replay_split_holds_out_at_most_half_spread_through_the_index():
    index = SuffixIndex([[i, i + 1] for i in range(10)])
    texts, rest = auto.replay_split(index, count=32)
    assert texts == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert rest.sequences() == [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10]]
    texts, rest = auto.replay_split(index, count=2)
    assert texts == [[0, 1], [5, 6]] and len(rest) == 8


def test_replayed_tau_counts_the_greedy_walk_over_the_text(target):
    """Suffix decoding on a 20-token text whose copies fill the index, 5 levels at most; a match of m tokens is
    continued by at most m (max_spec_factor 1), the prompt is the text's first token. Budget 2: +2 (a 1-token
    match), then +3 five times, then +2 (a level left): 19 tokens in 7 rounds. Budget 4: +2, +4 (3-token match),
    +5, +5, +3 (2 levels left): 19 in 5. Budget 8: +2, +4, +6, +6, +1 (no level left): 19 in 5."""
    trees = auto.TextTrees("suffix", SuffixIndex([TEXT] * 10))
    tau = auto.replayed_tau(trees, budgets=(2, 4, 8), max_depth=5)
    assert tau == pytest.approx({2: 19 / 7, 4: 19 / 5, 8: 19 / 5})
    # prompt lookup alone finds nothing in a text without repeats: one token a round
    assert auto.replayed_tau(auto.TextTrees("lookup", SuffixIndex([TEXT] * 10), suffix=False),
                             budgets=(2, 8), max_depth=5) == {2: 1.0, 8: 1.0}


@pytest.mark.parametrize(("v_tree", "budget"), [
    (lambda b: 1.0 + 0.005 * b, 4),  # width nearly free: τ(4) = τ(8), and 4 nodes cost less
    (lambda b: 1.0 + 0.5 * b, 2),  # B=2 2.71 / 2.0 beats B=4 3.8 / 3.0
])
def test_without_a_draft_model_the_budget_comes_from_the_replayed_trees(models, target, monkeypatch, v_tree, budget):
    monkeypatch.setattr(auto, "measure_costs", lambda *a, **k: flat_costs(v_tree))
    monkeypatch.setattr(auto, "TREE_BUDGETS", (2, 4, 8))
    lines = []
    trees = auto.TextTrees("suffix", SuffixIndex([TEXT] * 10))
    choice = budget_of(models[0], None, trees, max_depth=5, log=lines.append)
    assert choice == auto.BudgetChoice([(128, budget)], "measured on this machine, τ replayed on 5 responses")
    assert any(line.startswith("tree budget auto: replaying suffix's trees of 2-8 nodes on 5 of the suffix index's "
                               "responses, once") for line in lines)
    (replayed,) = [json.loads(f.read_text())
                   for f in (draftops_home() / "machine_choice" / auto.REPLAYED).glob("*.json")]
    assert replayed["items"]["value"] == pytest.approx({"2": 19 / 7, "4": 19 / 5, "8": 19 / 5})
    monkeypatch.setattr(auto, "replayed_tau", lambda *a, **k: pytest.fail("replayed again"))
    assert budget_of(models[0], None, trees, max_depth=5, log=lines.append) == choice
    small = auto.TextTrees("suffix", SuffixIndex([TEXT] * 7))
    assert budget_of(models[0], None, small, max_depth=5).source == (
        "built-in schedule: no draft model, and too small a suffix index to replay prompt lookup's and suffix "
        "decoding's trees on")


def test_the_suffix_only_decoder_runs_the_replayed_schedule(models, target, monkeypatch, tmp_path):
    monkeypatch.setattr(auto, "measure_costs", lambda *a, **k: flat_costs(lambda b: 1.0 + 0.5 * b))
    SuffixIndex([TEXT] * 10).save(tmp_path / "index.json")
    decode = DecodeConfig(suffix_index=str(tmp_path / "index.json"))
    decoder = build_decoder(models[0], None, decode, kind="suffix")
    assert decoder.drafter.schedule.entries == ((128, 2),)
    assert decoder.generate(TEXT[:3], max_new_tokens=20).token_ids == greedy_reference(target, TEXT[:3], 20)


def draft_costs(level: float):
    """`flat_costs` with tree verifies of 1 + 0.02 B target steps and a draft level costing `level` target steps."""
    costs = flat_costs(lambda b: 1.0 + 0.02 * b)
    costs["drafts"]["draft"]["c"] = {"1": [level], "5": [level]}
    return costs


@pytest.mark.parametrize(("level", "index", "sources"), [
    # a draft level as dear as a target step, and responses suffix decoding finds again: the draft is left out
    (1.0, [TEXT] * 10, "lookup+suffix"),
    # a cheap draft, and responses that never repeat: the draft stays
    (0.02, [[100 + 20 * i + j for j in range(20)] for i in range(10)], "lookup+suffix+draft"),
])
def test_the_decoder_leaves_out_a_draft_that_costs_more_than_it_brings(models, target, monkeypatch, tmp_path, capsys,
                                                                       level, index, sources):
    monkeypatch.setattr(auto, "measure_costs", lambda *a, **k: draft_costs(level))
    SuffixIndex(index).save(tmp_path / "index.json")
    decode = DecodeConfig(suffix_index=str(tmp_path / "index.json"))
    decoder = build_decoder(*models, decode)
    names = [s.name.split("(")[0] for s in decoder.drafter.sources]
    assert "+".join(names) == sources, decoder.drafter.name
    said = capsys.readouterr().err
    assert ("draft left out" if "draft" not in names else "draft kept") in said
    assert decoder.generate(TEXT[:3], max_new_tokens=12).token_ids == greedy_reference(target, TEXT[:3], 12)
    always = build_decoder(*models, DecodeConfig(suffix_index=str(tmp_path / "index.json"), use_draft="always"))
    assert always.drafter.sources[-1].name.startswith("draft")

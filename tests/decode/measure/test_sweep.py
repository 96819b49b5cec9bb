"""The sweep: γ schedules in the decoder, the greedy walk (exact target calls), the cost model and the CLI."""

import json
from types import SimpleNamespace

import mlflow
import pytest
import torch

from decode.acceptance import (
    analytic_acceptance,
    break_even_alpha,
    expected_speedup,
    expected_tokens,
    greedy_block,
    walk,
)
from decode.drafters.lookup import PromptLookupDrafter
from decode.factory import model_decoder
from decode.measure.sweep_acceptance import at_context, lookup_block, spread
from decode.measure.sweep_prediction import cell_break_even_alpha, predict_batches, predicted_seconds
from decode.runtime.forward import ModelRunner, greedy_decode
from decode.speculative import GammaPolicy
from pipeline.cli import main
from pipeline.config import load_config
from pipeline.sources import save_checkpoint
from pipeline.traffic import Request
from tests.conftest import make_tiny_model, make_tokenizer
from tests.decode.tiny import greedy_reference


def prompt_of(seed: int, length: int = 8) -> list[int]:
    torch.manual_seed(seed)
    phrase = torch.randint(0, 128, (4,)).tolist()
    return (phrase + torch.randint(0, 128, (length,)).tolist() + phrase)[:length + 4]


def test_gamma_schedule_in_the_decoder(target, close_draft):
    prompt = prompt_of(0)
    decoder = model_decoder(target, close_draft, GammaPolicy.scheduled([(len(prompt) + 10, 1), (500, 3)]))
    stats = decoder.generate(prompt, max_new_tokens=30).stats
    assert decoder.generate(prompt, max_new_tokens=30).token_ids == greedy_reference(target, prompt, 30)
    assert len(stats.drafted_at) == 3  # γ=1 early, γ=3 later, never 5
    assert stats.drafted_at[0] > stats.drafted_at[1]
    for bad in ([], [(10, 0)], [(20, 2), (10, 3)]):
        with pytest.raises(ValueError, match="gamma_schedule must be"):
            GammaPolicy.scheduled(bad)


@pytest.mark.parametrize("lean", [True, False])
def test_greedy_decode_matches_uncached_reference(target, lean):
    runner = ModelRunner(target, lean)
    assert (runner.lean is not None) == lean
    assert greedy_decode(runner, prompt_of(1), 12) == greedy_reference(target, prompt_of(1), 12)
    assert greedy_decode(runner, prompt_of(1), 0) == []
    reference = greedy_reference(target, prompt_of(1), 12)
    assert (greedy_decode(runner, prompt_of(1), 12, eos_token_ids=[reference[4]])
            == reference[:reference.index(reference[4]) + 1])


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_walk_gives_the_decoders_exact_counts(target, close_draft, gamma):
    """Under greedy decoding the walk over teacher-forced matches replays the decoder round by round."""
    n = 40
    for seed in range(3):
        prompt = prompt_of(seed)
        response = greedy_decode(ModelRunner(target), prompt, n)
        matches = analytic_acceptance(target, close_draft, [prompt + response], [len(prompt)], temperature=0.0)
        for draft, block in ((close_draft, greedy_block(matches.per_position[0])),
                             (PromptLookupDrafter.for_model(target), None)):
            block = block or lookup_block(draft, prompt, response)
            stats = model_decoder(target, draft, gamma).generate(prompt, max_new_tokens=n).stats
            w = walk(block, n, gamma)
            assert (w.calls, w.drafted, w.verified, w.accepted) == (
                stats.target_calls, stats.drafted, stats.verified, stats.accepted)


def test_break_even_alpha():
    assert break_even_alpha(1, 0.1, 1.2) == pytest.approx(0.3)  # (1 + α) / (c + v) = 1
    alpha = break_even_alpha(4, 0.2, 1.4)
    assert expected_speedup(alpha, 4, 0.2, 1.4) == pytest.approx(1.0)
    assert break_even_alpha(3, 0.0, 1.0) == 0.0 and break_even_alpha(2, 1.0, 2.0) == 1.0


def test_cell_break_even_pays_back_the_draft_prefill():
    k = {"target_step_s": 0.04, "draft_round_s": 4 * 0.004, "verify_s": 0.06, "target_prefill_s": 0.5,
         "draft_prefill_s": 0.1, "c": 0.1, "v": 1.5, "verify_s_by_tokens": {5: 0.06}}
    alpha = cell_break_even_alpha(k, 4, 128)
    target_s, spec_s = predicted_seconds(k, 128, {"4": 128 / expected_tokens(alpha, 4)})
    assert target_s == pytest.approx(spec_s)
    assert alpha > break_even_alpha(4, 0.1, 1.5)  # the prefill raises the bar
    assert cell_break_even_alpha(k, 4, 2) == 1.0  # 2 tokens cannot pay for a 100 ms draft prefill


def test_spread_and_at_context():
    requests = [Request(f"r{i}", c, (), None) for i, c in enumerate("aaabbc")]
    assert [r.id for r in spread(requests, 4)] == ["r0", "r3", "r5", "r1"]
    assert at_context([7, 8, 9], [1, 2, 3, 4], 6) == [2, 3, 4, 7, 8, 9]
    assert at_context([7, 8, 9], [1, 2], 7) == [1, 2, 1, 2, 7, 8, 9]
    assert at_context([7, 8, 9], [1], 2) == [8, 9]


PROMPTS = ["what is one and two", "write python code to sort a list", "sum three four five",
           "explain the function please", "hello world how is the story", "write a short poem"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep_cli")
    tokenizer = make_tokenizer()
    target = save_checkpoint(make_tiny_model(len(tokenizer), seed=0), tokenizer, root / "target")
    draft = save_checkpoint(make_tiny_model(len(tokenizer), seed=1, layers=1), tokenizer, root / "draft")
    traffic = root / "traffic.jsonl"
    traffic.write_text("".join(json.dumps({"id": f"r{i}", "category": ["math", "code"][i % 2], "prompt": p}) + "\n"
                               for i, p in enumerate(PROMPTS)))
    return str(target), str(draft), str(traffic)


def test_sweep_cli(checkpoints, capsys, tmp_path):
    target, draft, traffic = checkpoints
    assert main(["sweep", "--target", target, "--traffic", traffic, "--drafts",
                 f"{draft},target-layers:1:20,prompt-lookup,models:/absent@champion?,{draft}", "--gammas", "1,3",
                 "--contexts", "16,40", "--max-new-tokens", "4,8", "--analytic-prompts", "3",
                 "--measure-prompts", "2", "--reps", "2", "--batches", "1,2,4", "--batch-context", "24",
                 "--out", str(tmp_path), "--json", "device=cpu", "tracking.system_metrics=false"]) == 0
    report = json.loads(capsys.readouterr().out)
    drafts = [draft, "target-layers:1:20", "prompt-lookup"]
    assert list(report["drafts"]) == drafts and report["drafts"]["target-layers:1:20"]["reduced_vocab"] >= 20
    assert "optional draft models:/absent@champion skipped" in report["notes"][0]
    assert f"{draft} is the same draft as {draft}: swept once" in report["notes"][1]
    # llama.cpp's target alone joins the quantization table only where llama-server is built and the target is a GGUF
    assert any(n.startswith("no llama.cpp row in the quantization table: ") for n in report["notes"])
    assert len(report["cells"]) == 3 * 2 * 2 * 2 and len(report["best"]) == 4
    assert all(c["predicted_speedup"] > 0 and 0 <= c["break_even_alpha"] <= 1 for c in report["cells"])
    costs = report["costs"]
    assert costs["contexts"] == [16, 40] and set(costs["target"]["v"]) == {"2", "3", "4"}
    assert all(v > 0 for v in costs["target"]["v"]["4"]) and set(costs["drafts"][draft]["c"]) == {"1", "3"}
    assert max(costs["drafts"]["prompt-lookup"]["prefill_s"]) < 1e-3
    per_gamma = report["acceptance"][draft]["per_gamma"]
    assert set(per_gamma) == {"1", "3"} and set(per_gamma["3"]) == {"4", "8"}
    assert ("analytic_alpha" in report["acceptance"][draft]
            and "analytic_alpha" not in report["acceptance"]["prompt-lookup"])
    # token trees: v_tree per budget, rank acceptances of the draft models, a budget schedule for one of them
    budgets = [2, 3, 4, 8, 16, 32, 64]
    assert report["settings"]["tree_budgets"] == budgets and set(costs["target"]["v_tree"]) == {str(b) for b in budgets}
    assert all(len(v) == 2 and min(v) > 0 for v in costs["target"]["v_tree"].values())
    ranks = report["acceptance"][draft]["rank_acceptance"]
    assert len(ranks) == 64 and 0 < sum(ranks) <= 1 + 1e-9
    assert ranks[0] == pytest.approx(report["acceptance"][draft]["analytic_alpha"]["8"]["value"])  # rank 1 = a match
    assert "rank_acceptance" not in report["acceptance"]["prompt-lookup"]
    trees = report["tree_budgets"]
    assert trees["max_depth"] == 3 and len(trees["rows"]) == 2 * 2 * 7 and len(trees["chains"]) == 2 * 2
    assert {r["draft"] for r in trees["rows"]} == {draft, "target-layers:1:20"}
    assert all(r["predicted_tokens_per_s"] > 0 and 1 <= r["depth"] <= 3 and r["tau"] >= 1 for r in trees["rows"])
    # the batch axis: costs of 1, 2 and 4 sequences of 24 tokens, every draft's speedup by batch size
    batch = report["batch"]
    assert batch["costs"]["batches"] == [1, 2, 4] and batch["costs"]["context"] == 24
    assert set(batch["costs"]["drafts"]) == {draft, "target-layers:1:20"} and batch["costs"]["skipped"] == []
    assert set(batch["costs"]["target"]["v"]) == {"2", "3", "4"}
    assert all(len(x) == 3 and min(x) > 0 for x in batch["costs"]["target"]["verify_s"].values())
    assert [(r["draft"], r["batch"]) for r in batch["rows"]] == [(d, b) for d in drafts for b in (1, 2, 4)]
    assert all(r["predicted_speedup"] == max(r["per_gamma"].values()) and r["gamma"] in (1, 3)
               for r in batch["rows"])
    # batches up to 4 decoded for real with the model draft predicted best at B = 1, every output the target's own
    real = batch["measured"]
    assert [m["batch"] for m in real] == [1, 2, 4] and len({m["draft"] for m in real}) == 1
    assert real[0]["draft"] in (draft, "target-layers:1:20") and all(m["new_tokens"] == 8 for m in real)
    assert all(m["same_output_as_target"] == m["batch"] and m["measured_speedup"] > 0 for m in real)
    for d in drafts:
        stop = batch["stops_paying_at"][d]
        assert stop == next((r["batch"] for r in batch["rows"] if r["draft"] == d and r["predicted_speedup"] < 1),
                            None)
    # the int8 target beside the recommended draft, on the measured prompts
    quantization = report["quantization"]
    assert quantization["draft"] == report["recommendation"]["draft"] and quantization["new_tokens"] == 8
    assert set(quantization["methods"]) == {"target_only", "int8_target_only", "speculative"}
    assert quantization["methods"]["speculative"]["same_output_as_target"] == 2  # lossless
    assert quantization["methods"]["target_only"]["speedup"]["value"] == pytest.approx(1.0)
    int8 = quantization["methods"]["int8_target_only"]
    assert 0 <= int8["same_output_as_target"] <= 2 and 0 <= int8["mean_shared_prefix"] <= 8
    quality = quantization["int8_quality"]
    assert quality["positions"] == 3 * 8 and quality["kl"]["value"] >= 0 and 0 <= quality["agreement"]["value"] <= 1
    # every γ of the recommended draft at (16, 4), every draft's best γ there and at (40, 4)
    recommendation = report["recommendation"]
    measured = {(m["draft"], m["gamma"], m["context"], m["max_new_tokens"]) for m in report["measured"]}
    assert {(recommendation["draft"], g, 16, 4) for g in (1, 3)} <= measured
    assert {(d, c) for d, _, c, _ in measured} == {(d, c) for d in drafts for c in (16, 40)}
    assert {n for _, _, _, n in measured} == {4} and len(measured) == len(report["measured"]) <= 2 + 2 * 3
    assert all(m["same_output_as_target"] == 2 for m in report["measured"])  # lossless
    gaps = [m["speedup"]["value"] / m["predicted_speedup"] - 1 for m in report["measured"]]
    assert report["gap"]["mean_abs"] == pytest.approx(sum(abs(g) for g in gaps) / len(gaps))
    assert report["gap"]["max_abs"] == pytest.approx(max(abs(g) for g in gaps))
    assert recommendation["draft"] in drafts
    best_mean = {d: sum(b["per_draft"][d]["predicted_speedup"] for b in report["best"]) / 4 for d in drafts}
    assert recommendation["mean_predicted_speedup"] == pytest.approx(best_mean)
    assert recommendation["draft"] == max(best_mean, key=best_mean.get)
    # the draft-size axis: the two draft LMs (1 layer each), at context 16 and 8 new tokens, each decoded there
    sizes = report["draft_sizes"]
    assert (sizes["context"], sizes["max_new_tokens"]) == (16, 8)
    assert [(r["draft"], r["layers"]) for r in sizes["rows"]] == sorted([(draft, 1), ("target-layers:1:20", 1)])
    for r in sizes["rows"]:
        cell = max((c for c in report["cells"] if c["draft"] == r["draft"] and c["context"] == 16
                    and c["max_new_tokens"] == 8), key=lambda c: c["predicted_speedup"])
        assert (r["gamma"], r["c"], r["predicted_speedup"]) == (cell["gamma"], cell["c"], cell["predicted_speedup"])
        assert r["alpha"] == report["acceptance"][r["draft"]]["analytic_alpha"]["8"]
        assert r["mean_predicted_speedup"] == pytest.approx(best_mean[r["draft"]])
        assert r["measured"]["context"] == 16 and r["measured"]["same_output_as_target"] == 2
        assert r["parameters"] > 0
    assert sizes["recommended"]["draft"] == max(sizes["rows"], key=lambda r: r["mean_predicted_speedup"])["draft"]
    tuned = load_config(tmp_path / "decode_config.yaml")
    assert [list(e) for e in tuned.decode.gamma_schedule] == recommendation["gamma_schedule"]
    assert tuned.target == target and tuned.decode.gamma == recommendation["gamma_schedule"][0][1]
    tree_schedule = recommendation["tree_budget_schedule"]
    assert recommendation["tree_draft"] in (draft, "target-layers:1:20") and tree_schedule[-1][0] == 40
    best_budgets = [shape["budget"] for shape in recommendation["tree_shapes"]]  # per context; the schedule merges
    assert [b for _, b in tree_schedule] == [b for i, b in enumerate(best_budgets) if b not in best_budgets[i - 1 : i]]
    # the written config carries the tree budget schedule too (trees are the default decoder)
    assert [list(e) for e in tuned.decode.tree_budget_schedule] == tree_schedule and tuned.decode.tree_budget == 0
    widest = max(shape["width"] for shape in recommendation["tree_shapes"])
    assert tuned.decode.tree_branching == max(4, widest)
    assert (tmp_path / "decode_config.yaml").read_text().startswith("# Written by `draftops sweep`")
    names = {"sweep.json", "sweep.md", "decode_config.yaml", "speedup_vs_gamma.png", "speedup_heatmap.png",
             "break_even_alpha.png", "measured_vs_predicted.png", "tree_budget.png", "batch.png",
             "quantization.png", "draft_size.png"}
    assert names <= {p.name for p in tmp_path.iterdir()}
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(report["mlflow_run_id"], "sweep")}
    assert artifacts == {f"sweep/{n}" for n in names}
    logged = mlflow.get_run(report["mlflow_run_id"]).data.metrics
    assert logged["sweep/gap_mean_abs"] == pytest.approx(report["gap"]["mean_abs"])
    best = report["best"][0]
    assert logged[f"sweep/best_speedup/ctx{best['context']}_gen{best['max_new_tokens']}"] == pytest.approx(
        best["predicted_speedup"])
    best_at_4 = max(r["predicted_speedup"] for r in batch["rows"] if r["batch"] == 4)
    assert logged["sweep/batch_best_speedup/b4"] == pytest.approx(best_at_4)
    assert logged["sweep/quantization/int8_agreement"] == pytest.approx(quality["agreement"]["value"])
    assert logged["sweep/size/recommended_layers"] == 1
    assert logged["sweep/size/mean_predicted_speedup/layers1"] == pytest.approx(
        max(r["mean_predicted_speedup"] for r in sizes["rows"]))
    page = (tmp_path / "sweep.md").read_text()
    assert "## Recommendation" in page and "## Token trees" in page and "## Batch size: B sequences of 24" in page
    assert "## Quantized or drafted: the int8 target beside" in page
    assert "## Draft size: acceptance against cost (context 16, 8 new tokens)" in page
    assert "Recommended draft size on this machine: **1 layers**" in page
    assert f"decode.tree_budget_schedule {tree_schedule}" in page

    # the written config drives the decoder
    assert main(["decode", "--config", str(tmp_path / "decode_config.yaml"), "--draft",
                 "prompt-lookup", "--prompt", "what is one and two", "--max-new-tokens", "6", "--json",
                 "device=cpu"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["new_tokens"] == 6
    # and the recommended tree budget schedule, as an override
    assert main(["decode", "--target", target, "--draft", draft, "--prompt", "what is one and two",
                 "--max-new-tokens", "6", "--json", "device=cpu",
                 f"decode.tree_budget_schedule={json.dumps(tree_schedule)}"]) == 0
    decoded = json.loads(capsys.readouterr().out)
    assert decoded["stats"]["new_tokens"] == 6 and decoded["drafter"].startswith("tree(budget_schedule=")


def test_sweep_cli_errors(checkpoints, capsys, tmp_path):
    target, _, traffic = checkpoints
    assert main(["sweep", "--target", target, "--traffic", traffic, "--drafts", "prompt-lookup", "--contexts", "500",
                 "--max-new-tokens", "32", "--out", str(tmp_path), "device=cpu"]) == 2
    assert "exceed the target's 512 positions" in capsys.readouterr().err
    assert main(["eval", "--target", target, "--draft", "prompt-lookup", "--traffic", traffic, "device=cpu"]) == 2
    assert "this command needs a draft model" in capsys.readouterr().err


@pytest.mark.parametrize("overrides", [["decode.tree_budget_schedule=null"],
                                       ["decode.tree_budget=4", "decode.suffix=false"]], ids=["chain", "tree"])
def test_bench_with_prompt_lookup(checkpoints, capsys, tmp_path, overrides):
    target, _, traffic = checkpoints
    assert main(["bench", "--target", target, "--draft", "prompt-lookup", "--traffic", traffic, "--split", "all",
                 "--limit", "3", "--max-new-tokens", "8", "--gamma", "3", "--out", str(tmp_path), "--json",
                 "device=cpu", *overrides]) == 0
    report = json.loads(capsys.readouterr().out)
    trees = overrides[0] == "decode.tree_budget=4"
    assert report["drafters"]["speculative"].startswith("tree(" if trees else "lookup(")
    # with trees, prompt lookup in chain rounds runs beside them
    assert set(report["methods"]) == {"target_only", "target_only_torch", "plain", "speculative", "hf_prompt_lookup",
                                      *(["chain"] if trees else [])}
    assert report["methods"]["speculative"]["same_output_as_target"] == 3
    assert report["methods"]["hf_prompt_lookup"]["same_output_as_target"] == 3
    assert report["draft"] == "prompt-lookup" and 0 < report["costs"]["c"] < 1


def test_rounds_are_charged_the_verify_they_ran():
    """A lookup round without a match is a one-token step; one with a 2-token match a 3-token verify."""
    k = {"target_step_s": 0.04, "draft_round_s": 0.001, "target_prefill_s": 0.5, "draft_prefill_s": 0.0,
         "verify_s_by_tokens": {1: 0.04, 2: 0.05, 3: 0.055, 5: 0.06}}
    _, spec_s = predicted_seconds(k, 40, {"0": 20, "2": 5, "4": 2})
    assert spec_s == pytest.approx(0.5 + 20 * 0.041 + 5 * 0.056 + 2 * 0.061)
    lookup = PromptLookupDrafter(100, max_ngram=2)
    prompt, response = [1, 2, 3, 9], [1, 2, 3, 7, 8, 1, 2]
    w = walk(lookup_block(lookup, prompt, response), len(response), 4)
    assert sum(w.rounds.values()) == w.calls and sum(d * n for d, n in w.rounds.items()) == w.drafted
    assert w.rounds[0] >= 1  # "7" and "8" never occurred before: rounds without a proposal


def test_batch_axis_charges_each_round_its_verify_at_that_batch_size():
    """Hand values: 10 new tokens per sequence; a draft model (steps of 2 ms at B=1, 4 ms at B=8) and prompt lookup
    (1 ms a lookup, B lookups a round) against a target whose verify grows with B."""
    batch_costs = {"context": 16, "batches": [1, 8], "skipped": ["feature"],
                   "target": {"step_s": [0.02, 0.04], "verify_s": {"2": [0.021, 0.09], "3": [0.022, 0.13]}},
                   "drafts": {"model": {"step_s": [0.002, 0.004], "c": [0.1, 0.1]}}}
    costs = {"contexts": [16], "drafts": {"lookup": {"round_s": {"1": [0.001], "2": [0.001]}}}}
    walked = {"1": {"10": {"rounds_per_prompt": {"1": 5}, "alpha": {"value": 1.0}, "tau": {"value": 2.0}}},
              "2": {"10": {"rounds_per_prompt": {"2": 3, "0": 1}, "alpha": {"value": 0.9}, "tau": {"value": 2.5}}}}
    acceptance = {name: {"per_gamma": walked} for name in ("model", "lookup", "feature")}
    out = predict_batches(batch_costs, costs, acceptance, ["lookup"], [1, 2], 10)
    rows = {(r["draft"], r["batch"]): r for r in out["rows"]}
    assert set(rows) == {("model", 1), ("model", 8), ("lookup", 1), ("lookup", 8)}  # the feature draft: not measured
    # B=1, model: γ=1: 5 rounds of (2 ms + 21 ms); γ=2: 3 × (4 + 22) + 1 × (4 + 20 ms, a plain step), against 10 × 20 ms
    assert rows[("model", 1)]["per_gamma"] == pytest.approx({"1": 0.2 / 0.115, "2": 0.2 / 0.102})
    assert rows[("model", 1)]["gamma"] == 2 and rows[("model", 1)]["v"] == pytest.approx(0.022 / 0.02)
    # B=8: the verify costs 2.25-3.25 steps; γ=2: 3 × (8 + 130) + (8 + 40) ms against 10 × 40 ms
    assert rows[("model", 8)]["per_gamma"] == pytest.approx({"1": 0.4 / 0.47, "2": 0.4 / 0.462})
    # lookup: B lookups a round
    assert rows[("lookup", 1)]["per_gamma"] == pytest.approx({"1": 0.2 / 0.11, "2": 0.2 / 0.090})
    assert rows[("lookup", 8)]["per_gamma"] == pytest.approx({"1": 0.4 / 0.49, "2": 0.4 / 0.462})
    assert rows[("lookup", 8)]["c"] == pytest.approx(8 * 0.001 / (2 * 0.04))
    assert rows[("lookup", 8)]["break_even_alpha"] == 1.0  # γc + v = 0.2 + 3.25 >= γ + 1: never pays
    assert (rows[("model", 8)]["alpha"], rows[("model", 8)]["tau"]) == (0.9, 2.5)
    assert out["stops_paying_at"] == {"model": 8, "lookup": 8}


def test_greedy_responses_are_decoded_once_per_target_prompts_and_length(monkeypatch):
    import decode.measure.sweep_acceptance as sweep
    from tests.decode.tiny import tiny_llama

    model = tiny_llama(3)
    target = SimpleNamespace(model=model, fingerprint="t1")
    prompts = [[5, 9, 2], [7, 7, 1, 4]]
    first = sweep.greedy_responses(target, prompts, 6)
    assert first == [greedy_reference(model, p, 6) for p in prompts]
    monkeypatch.setattr(sweep, "greedy_decode", lambda *a: pytest.fail("decoded again"))
    assert sweep.greedy_responses(target, prompts, 6) == first
    with pytest.raises(pytest.fail.Exception, match="decoded again"):  # another target, prompt set or length
        sweep.greedy_responses(SimpleNamespace(model=model, fingerprint="t2"), prompts, 6)

import json

import mlflow
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from decode.measure.bench import run_bench
from decode.measure.bench_report import markdown
from decode.models.layer_draft import full_vocab_copy
from decode.runtime.lean import lean_problem
from decode.serving.loading import load_draft, load_model
from pipeline.cli import main
from pipeline.config import DecodeConfig
from pipeline.sources import HF_ASSISTANT_DIR, save_checkpoint
from pipeline.traffic import Request, encode_prompt
from tests.conftest import make_tiny_model, make_tokenizer
from tests.decode.tiny import greedy_reference
from tests.families import FAMILIES, TEXT, WINDOWED, save_family

PROMPTS = [("math", "what is one and two"), ("code", "write python code to sort a list"),
           ("math", "sum three four five"), ("code", "explain the function please"),
           ("chat", "hello world how is the story"), ("chat", "write a short poem")]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode_cli")
    tokenizer = make_tokenizer()
    target = save_checkpoint(make_tiny_model(len(tokenizer), seed=0), tokenizer, root / "target")
    draft = save_checkpoint(make_tiny_model(len(tokenizer), seed=1, layers=1), tokenizer, root / "draft")
    reduced = make_tiny_model(len(tokenizer), seed=2, layers=1)
    token_ids = torch.arange(0, len(tokenizer), 2)
    reduced.lm_head = torch.nn.Linear(64, len(token_ids), bias=False)
    reduced_dir = save_checkpoint(reduced, tokenizer, root / "reduced", token_ids=token_ids)
    full_vocab_copy(reduced, token_ids).save_pretrained(reduced_dir / HF_ASSISTANT_DIR)
    traffic = root / "traffic.jsonl"
    traffic.write_text("".join(json.dumps({"id": f"r{i}", "category": c, "prompt": p}) + "\n"
                               for i, (c, p) in enumerate(PROMPTS)))
    return str(target), str(draft), str(traffic), str(reduced_dir)


def run_json(capsys, argv) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_decode_prompt(checkpoints, capsys):
    target, draft, _, _ = checkpoints
    out = run_json(capsys, ["decode", "--target", target, "--draft", draft, "--prompt", "what is one and two",
                            "--max-new-tokens", "7", "--gamma", "3", "--json", "device=cpu"])
    assert len(out["token_ids"]) <= 7 and out["stats"]["new_tokens"] == len(out["token_ids"])
    assert out["stats"]["accepted"] <= out["stats"]["verified"] <= out["stats"]["drafted"]
    same = run_json(capsys, ["decode", "--target", target, "--draft", target, "--messages",
                             '[{"role": "user", "content": "what is one and two"}]', "--max-new-tokens", "7",
                             "--temperature", "1", "--seed", "3", "--json", "device=cpu"])
    assert same["stats"]["acceptance_rate"] == pytest.approx(1.0, abs=0.01)


def test_decode_rejects_bad_messages(checkpoints, capsys):
    target, draft, _, _ = checkpoints
    assert main(["decode", "--target", target, "--draft", draft, "--messages", "[{oops", "device=cpu"]) == 2
    assert "--messages is not valid JSON" in capsys.readouterr().err


# the default decoder: token trees of prompt lookup, suffix decoding (no index beside these drafts) and the draft
DEFAULT_DECODER = ("tree(budget_schedule=[[320, 4], [1280, 8], [2048, 4]]): lookup(n=2..3, branches=4)"
                   "+suffix(request only, no index)+draft(branching=4, min_confidence=0.4, rerank)")


def test_eval_logs_live_and_analytic_acceptance(checkpoints, capsys):
    target, draft, traffic, _ = checkpoints
    report = run_json(capsys, ["eval", "--target", target, "--draft", draft, "--traffic", traffic, "--split", "all",
                               "--limit", "5", "--max-new-tokens", "6", "--temperature", "1", "--json",
                               "device=cpu", "tracking.system_metrics=false"])
    assert report["n_prompts"] == 5
    assert (set(report["live"]["draft"]["per_category"]) == set(report["analytic"]["per_category"])
            == {"math", "code", "chat"})
    # the draft's own acceptance is measured in chain rounds, the decoder's as it runs
    assert report["drafters"] == {"draft": "draft(min_confidence=0.4)", "decoder": DEFAULT_DECODER}
    assert 0.0 <= report["analytic"]["alpha"]["value"] <= 1.0
    run = mlflow.get_run(report["mlflow_run_id"])
    assert run.data.metrics["acceptance/alpha_t1"] == pytest.approx(report["analytic"]["alpha"]["value"])
    assert run.data.metrics["acceptance/draft/math"] == pytest.approx(
        report["live"]["draft"]["per_category"]["math"]["acceptance_rate"]["value"])
    assert run.data.metrics["acceptance/decoder"] == pytest.approx(
        report["live"]["decoder"]["acceptance_rate"]["value"])
    assert run.data.params["drafter_decoder"] == DEFAULT_DECODER
    assert run.data.metrics["acceptance/pos_1"] == pytest.approx(report["live"]["draft"]["acceptance_at_position"][0])
    assert "acceptance/tau_gamma5" in run.data.metrics and "speed/tokens_per_s" in run.data.metrics
    bands = report["analytic"]["by_target_confidence"]
    assert [(b["low"], b["high"]) for b in bands] == [(0.0, 0.5), (0.5, 0.8), (0.8, 1.0)]
    assert sum(b["tokens"] for b in bands) == report["live"]["draft"]["new_tokens"]
    for band in bands:
        if band["tokens"]:
            assert run.data.metrics[f"acceptance/alpha_t1_by_target_confidence/{band['low']:g}-{band['high']:g}"] \
                == pytest.approx(band["alpha"])
    outside = report["analytic"]["outside_draft_vocabulary"]
    assert 0.0 <= outside < 1.0 and report["analytic"]["alpha"]["value"] <= 1 - outside
    assert run.data.metrics["acceptance/alpha_t1_outside_draft_vocabulary"] == pytest.approx(outside)
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id, "eval")}
    assert artifacts == {"eval/report.json", "eval/per_position.png", "eval/per_category.png"}


def test_bench_writes_reports(checkpoints, capsys, tmp_path):
    target, draft, traffic, _ = checkpoints
    report = run_json(capsys, ["bench", "--target", target, "--draft", draft, "--traffic", traffic, "--split", "all",
                               "--limit", "3", "--max-new-tokens", "6", "--gamma", "2", "--out", str(tmp_path),
                               "--json", "device=cpu"])
    # the default decoder's tree has three sources: each runs alone too, and the decoder and the draft in chains
    assert set(report["methods"]) == {"target_only", "target_only_torch", "plain", "speculative", "draft_only",
                                      "lookup_only", "suffix_only", "chain", "draft_only_chain", "hf_assisted"}
    assert report["drafters"]["speculative"] == DEFAULT_DECODER
    # cpu_linear auto, so the target alone also runs on torch's stock kernels: the faster of the two is the denominator
    assert report["settings"]["cpu_linear"] == "auto" and report["baseline"] in ("target_only", "target_only_torch")
    assert "speedup" not in report["methods"][report["baseline"]]
    assert report["settings"]["lookup_min_ngram"] == 2 and report["settings"]["draft_min_confidence"] == 0.4
    assert report["costs"]["c"] > 0 and report["costs"]["v"] > 0
    # tree rounds: the bound prices the tree's own verify; Leviathan's prediction is a chain's, so there is none
    assert report["costs"]["tree_budget"] > 0 and report["costs"]["v_tree"] > 0
    assert report["predicted_speedup"] is None and report["overhead_free_bound"] > 0
    assert all(m["same_output_as_target"] == 3 for m in report["methods"].values())
    in_run = report["in_run_costs"]
    assert in_run["c"] > 0 and in_run["v"] > 0 and 0 < in_run["model_time_share"] <= 1
    assert 0 <= report["break_even_alpha"] <= 1
    # the monitor holds the draft's own chain α against it: priced at the draft alone in chains, never a c of 0
    assert report["break_even_costs"]["row"] == "draft_only_chain" and report["break_even_costs"]["c"] > 0
    assert json.loads((tmp_path / "bench.json").read_text())["n_prompts"] == 3
    # llama.cpp's rows run only where llama-server is built and the target has a GGUF: here the report says why not
    assert report["llama_cpp"] is None and any(note.startswith("no llama_cpp rows: ") for note in report["notes"])
    assert main(["bench", "--target", target, "--draft", draft, "--traffic", traffic, "--split", "all", "--limit", "1",
                 "--out", str(tmp_path / "on"), "--llama-cpp", "on", "device=cpu"]) == 2
    assert "draftops: error: --llama-cpp on: " in capsys.readouterr().err
    text = (tmp_path / "bench.md").read_text()
    assert "Leviathan's prediction" in text and "target_only is HF generate on draftops' linear kernels" in text
    on_gpu = {**report, "settings": {**report["settings"], "device": "cuda:0"}}  # no CPU kernels to name there
    assert "target_only is HF generate on cuda:0, target_only_torch" in markdown(on_gpu)
    run = mlflow.get_run(report["mlflow_run_id"])
    assert run.data.metrics["speed/speedup_vs_target"] == pytest.approx(
        report["methods"]["speculative"]["speedup"]["value"])
    assert run.data.metrics["speed/cost_ratio_c"] == pytest.approx(report["costs"]["c"])
    assert run.data.metrics["speed/target_torch_kernels_tokens_per_s"] == pytest.approx(
        report["methods"]["target_only_torch"]["tokens_per_s"]["value"])
    assert run.data.metrics["acceptance/tau_gamma2"] == pytest.approx(report["tau"]["value"])


def test_bench_with_trees_runs_each_source_alone_the_chains_and_compared_budgets(checkpoints, capsys, tmp_path):
    from decode.drafters.suffix import SuffixIndex

    target, draft, traffic, _ = checkpoints
    index = SuffixIndex([[5, 6, 7, 8], [9, 10, 11]]).save(tmp_path / "index.json")
    common = ["bench", "--target", target, "--draft", draft, "--traffic", traffic, "--split", "all", "--limit", "2",
              "--max-new-tokens", "6", "--gamma", "2", "--llama-cpp", "off", "--json"]
    trees = ["device=cpu", "decode.tree_budget=4", "decode.suffix=true", f"decode.suffix_index={index}"]
    report = run_json(capsys, [*common, "--out", str(tmp_path / "b"), "--compare", "budget2 decode.tree_budget=2",
                               "--compare", "scheduled decode.tree_budget=0 decode.tree_budget_schedule=[[8,2],[64,6]]",
                               *trees])
    assert set(report["methods"]) == {"target_only", "target_only_torch", "plain", "speculative", "hf_assisted",
                                      "draft_only", "lookup_only", "suffix_only", "chain", "draft_only_chain",
                                      "budget2", "scheduled"}
    assert all(m["same_output_as_target"] == 2 for m in report["methods"].values())
    sources = "lookup(n=2..3, branches=4)+suffix(index of 2 sequences)+draft(branching=4, min_confidence=0.4, rerank)"
    assert report["drafters"] == {
        "speculative": f"tree(budget=4): {sources}",
        "lookup_only": "tree(budget=4): lookup(n=2..3, branches=4)",
        "suffix_only": "tree(budget=4): suffix(index of 2 sequences)",
        "draft_only": "tree(budget=4): draft(branching=4, min_confidence=0.4, rerank)",
        "chain": "lookup(n=2..3)+draft(min_confidence=0.4)", "draft_only_chain": "draft(min_confidence=0.4)",
        "budget2": f"tree(budget=2): {sources}", "scheduled": f"tree(budget_schedule=[[8, 2], [64, 6]]): {sources}"}
    decoders = report["decoders"]
    assert set(decoders) == set(report["drafters"])
    # each source alone accepts only its own tokens; the chains have no tree sources
    assert set(decoders["draft_only"]["accepted_by_source"]) <= {"draft"}
    assert set(decoders["lookup_only"]["accepted_by_source"]) <= {"lookup"}
    assert set(decoders["suffix_only"]["accepted_by_source"]) <= {"suffix"}
    assert decoders["chain"]["accepted_by_source"] == {}
    assert sum(decoders["speculative"]["accepted_by_source"].values()) > 0
    run = mlflow.get_run(report["mlflow_run_id"])
    assert run.data.metrics["speed/chain_speedup_vs_target"] == pytest.approx(
        report["methods"]["chain"]["speedup"]["value"])
    assert "speed/budget2_speedup_vs_target" in run.data.metrics
    assert run.data.metrics["speed/trees_vs_chain"] == pytest.approx(report["trees_vs_chain"]["value"])
    assert report["trees_vs_chain"]["n_prompts"] == 2
    # each compared decoder against the configured one and the chains: the throughput ratio of the two rows
    methods = report["methods"]
    for name in ("budget2", "scheduled"):
        assert set(report["compared"][name]) == {"vs_speculative", "vs_chain"}
        for against, row in (("vs_speculative", "speculative"), ("vs_chain", "chain")):
            ratio = report["compared"][name][against]
            assert ratio["n_prompts"] == 2
            assert ratio["value"] == pytest.approx(
                methods[name]["tokens_per_s"]["value"] / methods[row]["tokens_per_s"]["value"])
    text = (tmp_path / "b" / "bench.md").read_text()
    assert "speculative (trees) / chain" in text
    assert "- budget2 (--compare) / chain, paired over prompts: " in text
    assert "| suffix_only | tree(budget=4): suffix(index of 2 sequences) |" in text
    assert ("compared decoders (--compare): budget2: tree budget 2; scheduled: tree budget by context "
            "[[8, 2], [64, 6]] (configured)") in report["notes"]

    for bad in ("chain decode.tree_budget=2", "decode.tree_budget=2", "wide decode.tree_budget=-1",
                "other target=elsewhere"):
        assert main([*common, "--out", str(tmp_path / "bad"), "--compare", bad, *trees]) == 2
        assert "draftops: error:" in capsys.readouterr().err
    assert main([*common, "--out", str(tmp_path / "bad"), "device=cpu", "decode.tree_budget=4", "decode.suffix=true",
                 f"decode.suffix_index={tmp_path / 'missing.json'}"]) == 2
    assert "missing.json" in capsys.readouterr().err


def test_bench_with_compiled_passes_runs_every_draftops_row_compiled_beside_the_eager_plain_row(checkpoints, capsys,
                                                                                               tmp_path):
    target, draft, traffic, _ = checkpoints
    common = ["bench", "--target", target, "--draft", draft, "--traffic", traffic, "--split", "all", "--limit", "2",
              "--max-new-tokens", "5", "--json", "--llama-cpp", "off", "device=cpu", "decode.tree_budget=2",
              "decode.suffix=false", "decode.compiled=true"]
    report = run_json(capsys, [*common, "--out", str(tmp_path)])
    assert list(report["methods"])[:4] == ["target_only", "target_only_torch", "plain", "plain_eager"]
    assert all(row["same_output_as_target"] == 2 for row in report["methods"].values())
    assert any(note.startswith("decode.compiled: plain and the speculative rows") for note in report["notes"])
    assert main([*common, "--out", str(tmp_path / "bad"), "--compare", "eager decode.compiled=false"]) == 2
    assert "decode.compiled holds for the whole run" in capsys.readouterr().err


def test_bench_with_reduced_vocab_draft_gives_hf_its_full_vocab_copy(checkpoints, capsys, tmp_path):
    target, _, traffic, reduced = checkpoints
    report = run_json(capsys, ["bench", "--target", target, "--draft", reduced, "--traffic", traffic, "--split", "all",
                               "--limit", "2", "--max-new-tokens", "5", "--out", str(tmp_path), "--json",
                               "--llama-cpp", "off", "device=cpu", "decode.lookup_min_ngram=null",
                               "decode.draft_min_confidence=null", "decode.tree_budget_schedule=null"])
    assert set(report["methods"]) == {"target_only", "target_only_torch", "plain", "speculative", "hf_assisted"}
    assert report["methods"]["hf_assisted"]["same_output_as_target"] == 2
    assert report["notes"] == ["speculative: chain rounds",
                               "HF assisted generation uses the draft's full-vocabulary copy (hf_assistant/): "
                               "transformers cannot use a reduced-vocabulary head"]


def test_eval_bench_and_the_monitor_agree_on_each_acceptance_name(checkpoints, capsys, tmp_path):
    """`acceptance/draft` (the draft decoding alone, in chain rounds) and `acceptance/decoder` (the configured
    decoder) mean the same thing wherever they are logged: same draft, same prompts, same greedy decoding, same
    value."""
    from decode.serving.loading import load_model
    from monitor.check.prompt_acceptance import measure_live
    from pipeline.config import load_config
    from pipeline.traffic import load_traffic

    target, _, traffic, _ = checkpoints
    # a draft that is right part of the time: its head is its embeddings plus noise (tied tiny models repeat tokens)
    tokenizer = make_tokenizer()
    noisy = make_tiny_model(len(tokenizer), seed=1, layers=1)
    embeddings = noisy.model.embed_tokens.weight.detach().clone()
    noisy.config.tie_word_embeddings = False
    noisy.lm_head = torch.nn.Linear(64, len(tokenizer), bias=False)
    with torch.no_grad():
        noise = torch.randn(embeddings.shape, generator=torch.Generator().manual_seed(3))
        noisy.lm_head.weight.copy_(embeddings + 2.0 * embeddings.std() * noise)
    draft = str(save_checkpoint(noisy, tokenizer, tmp_path / "noisy"))
    common = ["--target", target, "--draft", draft, "--traffic", traffic, "--split", "all", "--max-new-tokens", "8"]
    overrides = ["device=cpu", "tracking.system_metrics=false", "decode.draft_min_confidence=null"]
    evaluated = run_json(capsys, ["eval", *common, "--json", *overrides])
    benched = run_json(capsys, ["bench", *common, "--out", str(tmp_path / "bench"), "--json", *overrides])
    eval_metrics = mlflow.get_run(evaluated["mlflow_run_id"]).data.metrics
    bench_metrics = mlflow.get_run(benched["mlflow_run_id"]).data.metrics

    cfg = load_config(None, [f"traffic.path={traffic}", "decode.max_new_tokens=8", *overrides])
    requests = load_traffic(traffic).requests
    live = measure_live(cfg, load_model(target, device="cpu"), load_model(draft, device="cpu"), requests)

    assert eval_metrics["acceptance/draft"] == pytest.approx(bench_metrics["acceptance/draft"], abs=1e-12)
    assert eval_metrics["acceptance/draft"] == pytest.approx(live.acceptance, abs=1e-12)
    assert eval_metrics["acceptance/decoder"] == pytest.approx(bench_metrics["acceptance/decoder"], abs=1e-12)
    assert 0 < live.acceptance < 1
    assert evaluated["drafters"]["decoder"] == benched["drafters"]["speculative"]
    assert evaluated["drafters"]["draft"] == benched["drafters"]["draft_only_chain"] == "draft"
    # chains of 3 as vLLM counts them, over the same greedy text: the same figures in eval and bench
    for name in ("acceptance/chain3_pos_1", "acceptance/chain3_pos_3", "acceptance/chain3_length"):
        assert eval_metrics[name] == pytest.approx(bench_metrics[name], abs=1e-12)
    assert evaluated["chain"]["per_position"] == benched["chain"]["per_position"]


def test_eval_prints_both_acceptances_for_people(checkpoints, capsys):
    target, draft, traffic, _ = checkpoints
    assert main(["eval", "--target", target, "--draft", draft, "--traffic", traffic, "--split", "all", "--limit", "3",
                 "--max-new-tokens", "6", "device=cpu", "tracking.system_metrics=false"]) == 0
    out = capsys.readouterr().out
    assert "draft acceptance α̂:" in out and "(draft(min_confidence=0.4))" in out
    assert "decoder acceptance:" in out and f"({DEFAULT_DECODER})" in out
    assert "τ of the draft alone:" in out and "MLflow run:" in out
    assert "the draft in chains of k=3 (vLLM's count, per draft): " in out


def test_bench_runs_a_challenger_draft_in_the_rows_of_the_draft_it_stands_in_for(checkpoints, capsys, tmp_path):
    from transformers import AutoModelForCausalLM

    from decode.serving.speculators import save_speculators
    from tests.decode.models.test_feature_draft import make_feature_draft

    _, draft, traffic, _ = checkpoints
    # four layers: a feature draft reads three distinct ones
    target = str(save_checkpoint(make_tiny_model(len(make_tokenizer()), seed=0, layers=4), make_tokenizer(),
                                 tmp_path / "target"))
    feature_dir = save_speculators(make_feature_draft(AutoModelForCausalLM.from_pretrained(target)),
                                   tmp_path / "feature", verifier_name_or_path=target)
    common = ["bench", "--target", target, "--traffic", traffic, "--split", "all", "--limit", "2",
              "--max-new-tokens", "6", "--gamma", "2", "--llama-cpp", "off", "--json", "--out", str(tmp_path / "b")]
    report = run_json(capsys, [*common, "--draft", draft, "--challenger", str(feature_dir), "device=cpu",
                               "decode.tree_budget=4"])
    challenger_rows = {"challenger", "challenger_draft_only", "challenger_draft_only_chain"}
    assert challenger_rows < set(report["methods"]) and challenger_rows < set(report["decoders"])
    assert all(m["same_output_as_target"] == 2 for m in report["methods"].values())
    assert report["drafters"]["challenger_draft_only"] == ("tree(budget=4): features(branching=4, min_confidence=0.4, "
                                                           "rerank)")
    assert report["drafters"]["challenger_draft_only_chain"].startswith("features")
    challenger = report["challenger"]
    assert challenger["source"] == str(feature_dir) and 0 < challenger["costs"]["c"] < 10
    chain = report["decoders"]["challenger_draft_only_chain"]
    assert challenger["alpha_draft"] == chain["acceptance_rate"]
    assert challenger["chain"]["k"] == 3 and report["chain"]["k"] == 3
    assert len(challenger["alpha_draft_at_position"]) == 2  # γ positions
    paired = challenger["vs_draft"]
    assert paired["n_prompts"] == report["n_prompts"] and paired["low"] <= paired["value"] <= paired["high"]
    assert f"- challenger draft {feature_dir}: draft step" in (tmp_path / "b" / "bench.md").read_text()
    assert any(note.startswith("challenger rows (challenger, challenger_draft_only, challenger_draft_only_chain)")
               for note in report["notes"])

    assert main([*common, "--draft", "prompt-lookup", "--challenger", draft, "device=cpu"]) == 2
    assert "not with prompt lookup alone" in capsys.readouterr().err


# --------------------------------------------------------------------------- every family's checkpoints

@torch.no_grad()
def transformers_greedy(path: str, prompt: list[int], max_new_tokens: int, eos: int) -> list[int]:
    """transformers' greedy output of the checkpoint at `path`: full forwards, no cache, up to its EOS."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = greedy_reference(model, prompt, max_new_tokens)
    return out[: out.index(eos) + 1] if eos in out else out


@pytest.mark.parametrize("window", [16, 4096])
@pytest.mark.parametrize("family", ["mistral", "gemma3", "phi3"])
def test_decode_on_sliding_windows_gives_the_targets_greedy_output(family, window, tmp_path, capsys):
    target, draft = save_family(tmp_path, family, window)
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompt = encode_prompt(Request("cli", "cli", ({"role": "user", "content": TEXT},)), tokenizer, 4096)
    assert len(prompt) > 16
    reference = transformers_greedy(target, prompt, 24, tokenizer.eos_token_id)
    common = ["decode", "--target", target, "--draft", draft, "--prompt", TEXT, "--max-new-tokens", "24", "--json",
              "device=cpu", "cpu_linear=torch"]
    for rounds in ([], ["decode.tree_budget_schedule=null"]):  # the default trees, then chains
        assert main([*common, *rounds]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["prompt_tokens"] == len(prompt) and out["token_ids"] == reference, rounds


@pytest.mark.parametrize("family", FAMILIES)
def test_bench_rows_of_every_family_are_the_targets_output(family, tmp_path):
    target_dir, draft_dir = save_family(tmp_path, family, 16 if family in WINDOWED else None)
    target = load_model(target_dir, device="cpu", dtype="float32", cpu_linear="torch")
    draft = load_draft(draft_dir, target, cpu_linear="torch")
    prompts = [encode_prompt(Request(str(i), "tiny", ({"role": "user", "content": text},)), target.tokenizer, 4096)
               for i, text in enumerate((TEXT, "hello world how is the story"))]
    assert lean_problem(target.model) is None  # eager passes: compiling takes minutes (tests/decode/test_lean*.py)
    report = run_bench(target, draft, prompts, ["tiny"] * 2, DecodeConfig(max_new_tokens=8), progress=False)
    assert all(row["same_output_as_target"] == 2 for row in report["methods"].values()), report["methods"]

"""Every supported family decodes losslessly, through the lean forward (`decode.runtime.lean_families`) and through
the transformers forward: tiny random-weight models of each (`tests.families`), chains and token trees, greedy
against the family's own target-only greedy (transformers, no cache, full forward) and sampled against its exact
distribution (chi-square, `tests.decode.test_lossless`). Sliding windows are exercised with windows shorter than the
text and the tree."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from decode.drafters.protocol import LOOKUP
from decode.factory import build_decoder, model_decoder
from decode.measure.bench import run_bench
from decode.runtime.lean import LeanDecoder
from decode.runtime.lean_families import FAMILY_NAMES
from decode.serving.loading import load_draft, load_model
from decode.speculative import SpeculativeDecoder
from pipeline.architectures import supported_families
from pipeline.cli import main
from pipeline.config import DecodeConfig
from pipeline.sources import ResolvedModel, save_checkpoint
from pipeline.traffic import Request, encode_prompt
from tests.conftest import make_tokenizer
from tests.decode.test_lossless import T1, check_first_two
from tests.decode.tiny import greedy_reference
from tests.families import FAMILIES, WINDOWED, perturbed, tiny_family

PROMPT = [5, 9, 2, 77, 3, 5, 9, 40, 11, 2, 77, 3]  # repeats: prompt lookup joins the default decoder's trees
NEW_TOKENS = 24


def resolved(model) -> ResolvedModel:
    return ResolvedModel("tiny", None, model, None, "", None)


def decoders(target, draft, lean: bool = True) -> dict[str, SpeculativeDecoder]:
    """The default decoder (token trees: prompt lookup, suffix decoding, the draft), a deep tree of the draft alone,
    and chain rounds."""
    default = DecodeConfig()
    return {"default": build_decoder(resolved(target), resolved(draft), default, lean=lean),
            "deep_tree": model_decoder(target, draft, 6, tree_budget=12, tree_branching=2, lean=lean),
            "chain": build_decoder(resolved(target), resolved(draft), default.chain_rounds(), lean=lean)}


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_is_the_targets(family, lean):
    # a window of 4 (where the family has one) is shorter than the text and than the deep tree; through the lean
    # forward (`decode.runtime.lean_families`: every family here) and through transformers'
    target = tiny_family(family, window=4 if family in WINDOWED else None)
    reference = greedy_reference(target, PROMPT, NEW_TOKENS)
    for name, decoder in decoders(target, perturbed(target, seed=1, noise=0.05), lean).items():
        assert (decoder.target_runner.lean is not None) == lean
        result = decoder.generate(PROMPT, max_new_tokens=NEW_TOKENS)
        assert result.token_ids == reference, name
        assert result.stats.accepted > 0, name


VOCAB = 16
SAMPLES = 300  # a tree pass blind to the window fails at chi-square 140 (p < 1e-20) here


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
@pytest.mark.parametrize("family", FAMILIES)
def test_sampling_is_the_targets_distribution(family, lean):
    # two layers (Gemma's: one sliding, one global); a window of 2 cuts the second token's view of the prompt
    shape = dict(vocab_size=VOCAB, init_range=0.15, window=2 if family in WINDOWED else None, layers=2)
    target = tiny_family(family, 10, **shape)
    tree = model_decoder(target, perturbed(target, seed=11, noise=0.15), 2, tree_budget=6, tree_branching=3,
                         lean=lean)
    check_first_two(target, tree, [3, 7], T1, samples=SAMPLES)
    other = tiny_family(family, 12, **shape)  # an unrelated draft of the family
    check_first_two(target, model_decoder(target, other, 2, lean=lean), [3, 7], T1, samples=SAMPLES)


# --------------------------------------------------------------------------- checkpoints: the CLI, bench, refusals

TEXT = ("write python code to sort a list of numbers one two three four five six seven eight nine ten and explain "
        "the function please")  # 40 tokens with the chat template: longer than a window of 16


def save_family(root, family: str, window: int | None = None, *, draft: bool = True) -> tuple[str, str]:
    """A float32 `family` target (and a perturbed copy as its draft) saved with the tests' word-level tokenizer."""
    tokenizer = make_tokenizer()
    target = tiny_family(family, window=window, vocab_size=len(tokenizer), dtype=torch.float32)
    target_dir = save_checkpoint(target, tokenizer, root / f"{family}-{window}")
    draft_dir = save_checkpoint(perturbed(target, 1, 0.05), tokenizer, root / f"{family}-{window}-draft") if draft \
        else None
    return str(target_dir), str(draft_dir)


@torch.no_grad()
def transformers_greedy(path: str, prompt: list[int], max_new_tokens: int, eos: int) -> list[int]:
    """transformers' greedy output of the checkpoint at `path`: full forwards, no cache, up to its EOS."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = greedy_reference(model, prompt, max_new_tokens)
    return out[: out.index(eos) + 1] if eos in out else out


@pytest.mark.parametrize("window", [16, 4096])
@pytest.mark.parametrize("family", ["mistral", "gemma3", "phi3"])
def test_decode_cli_on_sliding_windows(family, window, tmp_path, capsys):
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
def test_bench_rows_are_the_targets_output(family, tmp_path):
    target_dir, draft_dir = save_family(tmp_path, family, 16 if family in WINDOWED else None)
    target = load_model(target_dir, device="cpu", dtype="float32", cpu_linear="torch")
    draft = load_draft(draft_dir, target, cpu_linear="torch")
    prompts = [encode_prompt(Request(str(i), "tiny", ({"role": "user", "content": text},)), target.tokenizer, 4096)
               for i, text in enumerate((TEXT, "hello world how is the story"))]
    # `make bench` compiles the passes: where the lean forward does not run the family, it falls back to the eager
    # forward (where it does, compiling takes minutes: eager here, the lean tests check the compiled passes)
    fallback = not LeanDecoder.supports(target.model)
    report = run_bench(target, draft, prompts, ["tiny"] * 2, DecodeConfig(max_new_tokens=8, compiled=fallback),
                       progress=False)
    assert all(row["same_output_as_target"] == 2 for row in report["methods"].values()), report["methods"]
    assert fallback == any(note.startswith("decode.compiled does not apply") for note in report["notes"])


def test_compiled_passes_fall_back_to_the_eager_forward(capsys):
    """Every supported family runs on the lean forward, compiled too: a model it does not run (GPT-NeoX, which the CLI
    refuses, built here directly) decodes through transformers' forward, said once per model."""
    target = resolved(tiny_family("gpt_neox"))
    decoder = build_decoder(target, resolved(perturbed(target.model, 1, 0.05)), DecodeConfig(compiled=True))
    assert decoder.generate(PROMPT, max_new_tokens=8).token_ids == greedy_reference(target.model, PROMPT, 8)
    build_decoder(target, None, DecodeConfig(compiled=True), kind=LOOKUP)  # said once per model
    assert capsys.readouterr().err.splitlines() == [
        f"draftops: notice: this gpt_neox model runs on the transformers forward, not the lean one (the same tokens, "
        f"more time per call{extra}): the lean forward runs {FAMILY_NAMES} models in eval mode, attention eager or sdpa"
        for extra in ("; decode.compiled does not apply to it", "")]  # the target's, then the draft's


def test_an_unsupported_architecture_is_refused_before_loading(tmp_path, capsys):
    neox, _ = save_family(tmp_path, "gpt_neox", draft=False)
    capsys.readouterr()  # saving's progress bars
    assert main(["decode", "--target", neox, "--draft", neox, "--prompt", "hello", "device=cpu"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"draftops: error: {neox}: architecture GPTNeoXForCausalLM (model_type 'gpt_neox') is not supported: "
        f"draftops distills and decodes {supported_families()}"]
    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text(json.dumps({"id": "r0", "category": "tiny", "prompt": TEXT}) + "\n")
    out = tmp_path / "out"
    assert main(["distill", f"target={neox}", f"traffic.path={traffic}", "device=cpu", f"distill.output_dir={out}",
                 "distill.register_model=false"]) == 2
    err = capsys.readouterr().err
    assert "architecture GPTNeoXForCausalLM (model_type 'gpt_neox') is not supported" in err
    assert "Traceback" not in err and not out.exists()  # refused before any response was generated


def test_custom_code_is_refused_saying_why(tmp_path, capsys):
    neox, _ = save_family(tmp_path, "gpt_neox", draft=False)
    config = json.loads((Path(neox) / "config.json").read_text())
    config.update(model_type="tiny_custom", auto_map={"AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM"})
    (Path(neox) / "config.json").write_text(json.dumps(config))
    capsys.readouterr()  # saving's progress bars
    assert main(["decode", "--target", neox, "--draft", neox, "--prompt", "hello", "device=cpu"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"draftops: error: {neox}: its config asks for custom code (auto_map, model_type "
                           "'tiny_custom'): draftops does not set trust_remote_code, which would run Python shipped "
                           "with the checkpoint")
    # a supported family's checkpoint that also names custom code (as Phi-3's do) loads through transformers' class
    phi3, _ = save_family(tmp_path, "phi3", draft=False)
    config = json.loads((Path(phi3) / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"}
    (Path(phi3) / "config.json").write_text(json.dumps(config))
    assert load_model(phi3, device="cpu", dtype="float32", cpu_linear="torch").model.config.model_type == "phi3"

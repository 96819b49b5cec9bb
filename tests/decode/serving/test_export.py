"""`draftops export` (decode.serving.export): a layer draft with a reduced head comes out as a plain full-vocabulary
checkpoint that transformers loads and that scores the kept ids as the draft does; a feature draft comes out as its
speculators folder; the folders hold no draftops file and their config agrees with their weights; wrong formats,
sources and folders are refused; the command prints the serving command lines."""
from __future__ import annotations

import json
import shutil

import mlflow
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from decode.drafters.suffix import SuffixIndex
from decode.models.feature_draft import feature_draft_from_target
from decode.models.layer_draft import draft_from_target_layers, full_vocab_copy, reduce_vocabulary
from decode.serving.export import (
    FEATURES,
    LAYERS,
    ExportError,
    check_hf_folder,
    check_speculators_folder,
    draft_source,
    export_format,
    serving_commands,
)
from decode.serving.speculators import load_speculators
from distill.register import export_draft
from pipeline import registry
from pipeline.cli import main
from pipeline.config import load_config
from pipeline.sources import load_checkpoint, save_checkpoint
from tests.conftest import make_tiny_model, make_tokenizer
from tests.families import tiny_family

IDS = torch.tensor([[1, 5, 9, 3, 7, 12, 30, 2, 44, 17]])
DRAFTOPS_FILES = {"draft_vocab.json", "suffix_index.json", "draftops_config.yaml", "hf_assistant"}


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    """A 2-layer target and, from it: a one-layer draft with a reduced, perturbed head (exported as `make distill`
    does), the same without its hf_assistant/ copy, and a full-head one; a 4-layer target and a feature draft of it."""
    root = tmp_path_factory.mktemp("export_formats")
    tokenizer = make_tokenizer(extra_words=20)
    target = make_tiny_model(len(tokenizer), seed=0)
    save_checkpoint(target, tokenizer, root / "target")
    cfg = load_config(None, [f"target={root / 'target'}", "decode.gamma=3", "device=cpu"])
    token_ids = torch.tensor(sorted({0, 1, 2} | set(range(3, len(tokenizer), 3))))
    reduced = draft_from_target_layers(target, [1])
    reduce_vocabulary(reduced, token_ids, target.lm_head.weight)
    with torch.no_grad():
        torch.manual_seed(4)
        reduced.lm_head.weight.add_(0.5 * torch.randn_like(reduced.lm_head.weight))
    suffix = SuffixIndex([[5, 6, 7], [8, 9]])
    export_draft(reduced.eval(), tokenizer, root / "job" / "draft", token_ids=token_ids, cfg=cfg, suffix_index=suffix)
    save_checkpoint(reduced, tokenizer, root / "bare", token_ids=token_ids, config=cfg)
    export_draft(draft_from_target_layers(target, [0]).eval(), tokenizer, root / "full", token_ids=None, cfg=cfg)

    target4 = make_tiny_model(len(tokenizer), seed=3, layers=4)
    save_checkpoint(target4, tokenizer, root / "target4")
    feature = feature_draft_from_target(target4, token_ids)
    with torch.no_grad():
        torch.manual_seed(5)
        for name, parameter in feature.named_parameters():
            if not name.startswith("embed_tokens"):
                parameter.add_(0.1 * torch.randn_like(parameter))
    cfg4 = load_config(None, [f"target={root / 'target4'}", "decode.gamma=4", "device=cpu"])
    export_draft(feature.eval(), tokenizer, root / "feature", token_ids=token_ids, cfg=cfg4, suffix_index=suffix)
    return {"root": root, "tokenizer": tokenizer, "token_ids": token_ids, "vocab": len(tokenizer), "target4": target4,
            "feature": feature}


def shapes(path) -> dict[str, list[int]]:
    with safe_open(path / "model.safetensors", framework="numpy") as f:
        return {name: f.get_slice(name).get_shape() for name in f.keys()}


@torch.no_grad()
@pytest.mark.parametrize("fmt", ["hf", "vllm"])
@pytest.mark.parametrize("name", ["job/draft", "bare"], ids=["with-copy", "copy-built"])
def test_a_reduced_layer_draft_exports_full_vocab_and_scores_the_kept_ids_as_the_draft(drafts, tmp_path, fmt, name):
    source = drafts["root"] / name
    draft = draft_source(str(source))
    assert (draft.family, draft.target, draft.gamma) == (LAYERS, str(drafts["root"] / "target"), 3)
    out = export_format(draft, fmt, tmp_path / fmt, target_vocab_size=drafts["vocab"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [fmt]  # the temporary sibling was swapped in
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not names & DRAFTOPS_FILES

    config, weights, vocab = json.loads((out / "config.json").read_text()), shapes(out), drafts["vocab"]
    assert config["vocab_size"] == vocab and config["tie_word_embeddings"] is False
    assert weights["lm_head.weight"] == weights["model.embed_tokens.weight"] == [vocab, 64]
    assert check_hf_folder(out, vocab) == vocab

    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    original = load_checkpoint(source).eval()  # the draftops draft: its head has one row per kept id
    full, kept = exported(IDS).logits, original(IDS).logits
    token_ids = drafts["token_ids"]
    assert kept.shape[-1] == len(token_ids) < full.shape[-1] == vocab
    torch.testing.assert_close(full[..., token_ids], kept, atol=1e-5, rtol=1e-5)
    assert torch.equal(token_ids[kept.argmax(-1)], token_ids[full[..., token_ids].argmax(-1)])
    dropped = torch.ones(vocab, dtype=torch.bool)
    dropped[token_ids] = False
    assert torch.equal(full[..., dropped], torch.zeros_like(full[..., dropped]))  # ids the head dropped score 0
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer("write python code").input_ids == drafts["tokenizer"]("write python code").input_ids


@torch.no_grad()
def test_a_full_head_layer_draft_exports_as_its_own_tied_checkpoint(drafts, tmp_path):
    source = drafts["root"] / "full"
    out = export_format(draft_source(str(source)), "vllm", tmp_path / "vllm")
    assert sorted(p.name for p in out.iterdir()) == sorted(
        p.name for p in source.iterdir() if p.name not in DRAFTOPS_FILES)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and "lm_head.weight" not in shapes(out)
    assert check_hf_folder(out) == drafts["vocab"]
    torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(out).eval()(IDS).logits,
                               load_checkpoint(source).eval()(IDS).logits)


@torch.no_grad()
@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_a_feature_draft_exports_as_its_speculators_folder(drafts, tmp_path, fmt):
    draft = draft_source(str(drafts["root"] / "feature"))
    assert (draft.family, draft.target, draft.gamma) == (FEATURES, str(drafts["root"] / "target4"), 4)
    out = export_format(draft, fmt, tmp_path / fmt, target_vocab_size=drafts["vocab"])
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert check_speculators_folder(out) == drafts["vocab"]
    loaded = load_speculators(out, drafts["target4"])
    expected = {k: v for k, v in drafts["feature"].state_dict().items() if k != "embed_tokens.weight"}
    got = {k: v for k, v in loaded.state_dict().items() if k != "embed_tokens.weight"}
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    assert torch.equal(loaded.token_ids, drafts["token_ids"])


def test_formats_a_draft_has_not_and_unknown_formats_are_refused(drafts, tmp_path):
    layer, feature = draft_source(str(drafts["root"] / "job/draft")), draft_source(str(drafts["root"] / "feature"))
    with pytest.raises(ExportError, match="is a layer draft: it exports as hf, vllm or gguf, not speculators"):
        export_format(layer, "speculators", tmp_path / "a")
    with pytest.raises(ExportError, match=r"is a feature draft \(speculators Eagle3 folder\): it exports as vllm, "
                                          r"speculators or gguf, not hf"):
        export_format(feature, "hf", tmp_path / "b")
    with pytest.raises(ExportError, match="unknown format 'onnx': choose one of hf, vllm, speculators, gguf"):
        export_format(layer, "onnx", tmp_path / "c")
    assert list(tmp_path.iterdir()) == []


def test_sources_that_are_not_drafts_are_refused(drafts):
    with pytest.raises(ExportError, match="is not a draftops draft"):
        draft_source(str(drafts["root"] / "target"))
    with pytest.raises(ExportError, match="is a GGUF model, not a draftops draft"):
        draft_source("smollm2-135m-instruct")


def test_a_non_empty_folder_is_kept_unless_forced_and_the_draft_itself_never_replaced(drafts, tmp_path):
    draft = draft_source(str(drafts["root"] / "job/draft"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="exists and is not empty"):
        export_format(draft, "hf", out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    export_format(draft, "hf", out, force=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    for folder in (draft.path, draft.path.parent):
        with pytest.raises(ExportError, match="holds the draft itself"):
            export_format(draft, "hf", folder, force=True)
    assert (draft.path / "draft_vocab.json").is_file()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportError, match="exists and is not a folder"):
        export_format(draft, "hf", tmp_path / "file")


def test_a_draft_of_another_vocabulary_than_the_target_is_refused_and_nothing_is_left(drafts, tmp_path):
    vocab = drafts["vocab"]
    for name, fmt in (("job/draft", "vllm"), ("feature", "speculators")):
        with pytest.raises(ExportError, match=f"vocab_size {vocab} differs from the target's {vocab + 1}"):
            export_format(draft_source(str(drafts["root"] / name)), fmt, tmp_path / "out",
                          target_vocab_size=vocab + 1)
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its temporary sibling


def test_the_checks_catch_a_config_that_disagrees_with_its_weights(drafts, tmp_path):
    good = export_format(draft_source(str(drafts["root"] / "job/draft")), "hf", tmp_path / "hf")
    config = json.loads((good / "config.json").read_text())
    broken = tmp_path / "broken"
    shutil.copytree(good, broken)
    (broken / "config.json").write_text(json.dumps({**config, "vocab_size": drafts["vocab"] + 2}))
    with pytest.raises(ExportError, match=f"config vocab_size {drafts['vocab'] + 2}, embeddings"):
        check_hf_folder(broken)
    (broken / "config.json").write_text(json.dumps(config))
    (broken / "draft_vocab.json").write_text("{}")
    with pytest.raises(ExportError, match=r"holds draftops files \['draft_vocab.json'\]"):
        check_hf_folder(broken)

    spec = export_format(draft_source(str(drafts["root"] / "feature")), "speculators", tmp_path / "spec")
    saved = json.loads((spec / "config.json").read_text())
    (spec / "config.json").write_text(json.dumps({**saved, "draft_vocab_size": saved["draft_vocab_size"] + 1}))
    with pytest.raises(ExportError, match=f"draft_vocab_size {saved['draft_vocab_size'] + 1}, lm_head"):
        check_speculators_folder(spec)


def test_serving_commands_for_each_family(tmp_path):
    layer = "\n".join(serving_commands(LAYERS, "hf", tmp_path / "d", str(tmp_path), 3))
    assert "not tested on this CPU machine" in layer
    spec = json.dumps({"model": str(tmp_path / "d"), "method": "draft_model", "num_speculative_tokens": 3})
    assert f"vllm serve {tmp_path} --speculative-config '{spec}'" in layer
    assert (f"python -m sglang.launch_server --model-path {tmp_path} --speculative-algorithm STANDALONE "
            f"--speculative-draft-model-path {tmp_path / 'd'} --speculative-num-steps 3 --speculative-eagle-topk 1 "
            f"--speculative-num-draft-tokens 4") in layer
    assert "assistant_model=" in layer and "is not a local folder" not in layer
    feature = "\n".join(serving_commands(FEATURES, "vllm", tmp_path / "d", "org/model", 2))
    assert '"method": "eagle3", "num_speculative_tokens": 2' in feature and "--speculative-algorithm EAGLE3" in feature
    assert f"vllm serve {tmp_path / 'd'}   # the target named in its speculators_config" in feature
    assert "assistant_model=" not in feature
    assert "(org/model is not a local folder: give the engines the target's Hugging Face checkpoint" in feature


def test_draftops_export_writes_the_folder_and_prints_how_to_serve_it(drafts, tmp_path, capsys):
    source, out = drafts["root"] / "job/draft", tmp_path / "vllm"
    assert main(["export", str(source), "--format", "vllm", "--out", str(out), "device=cpu"]) == 0
    printed = capsys.readouterr().out
    assert f"exported the layers draft {source} as vllm to {out}" in printed
    assert f'"model": "{out}", "method": "draft_model", "num_speculative_tokens": 3' in printed
    assert f"--model-path {drafts['root'] / 'target'} --speculative-algorithm STANDALONE" in printed
    assert check_hf_folder(out, drafts["vocab"]) == drafts["vocab"]

    assert main(["export", str(source), "--format", "vllm", "--out", str(out)]) == 2
    assert "exists and is not empty (--force replaces it)" in capsys.readouterr().err
    assert main(["export", str(source), "--format", "speculators", "--out", str(tmp_path / "s")]) == 2
    assert "it exports as hf, vllm or gguf, not speculators" in capsys.readouterr().err
    assert main(["export", str(source), "--format", "vllm", "--out", str(out), "--force", "--gamma", "5",
                 "--target", "org/target"]) == 0
    printed = capsys.readouterr().out
    assert '"num_speculative_tokens": 5' in printed and "vllm serve org/target" in printed


def test_draftops_export_resolves_a_registered_feature_draft(drafts, tmp_path, capsys, mlflow_uri):
    mlflow.set_experiment("export")
    with mlflow.start_run():
        registry.register(drafts["root"] / "feature", "drafts", tags={}, description="feature draft")
    out = tmp_path / "spec"
    assert main(["export", "models:/drafts@champion", "--format", "speculators", "--out", str(out),
                 f"tracking.uri={mlflow_uri}"]) == 0
    printed = capsys.readouterr().out
    assert "exported the features draft models:/drafts@champion as speculators" in printed
    assert '"method": "eagle3", "num_speculative_tokens": 4' in printed
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert load_speculators(out, drafts["target4"]).lm_head.out_features == len(drafts["token_ids"])


def test_full_vocab_copy_of_a_tied_family_scores_the_kept_ids():
    """Gemma 2 (tied head, soft-capped logits): the HF copy of a reduced draft gives the draft's logits at the kept
    ids and leaves the draft's embeddings as they were."""
    target, kept = tiny_family("gemma2"), torch.arange(0, 128, 3)
    draft = draft_from_target_layers(target, [1]).eval()
    reduce_vocabulary(draft, kept, target.get_output_embeddings().weight.detach())
    embeddings = draft.get_input_embeddings().weight.clone()
    full = full_vocab_copy(draft, kept)
    with torch.no_grad():
        torch.testing.assert_close(full(IDS).logits[..., kept], draft(IDS).logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(draft.get_input_embeddings().weight, embeddings)
    assert torch.equal(full.get_input_embeddings().weight, embeddings)

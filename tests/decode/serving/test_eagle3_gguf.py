"""A feature draft as llama.cpp's EAGLE-3 GGUF (decode.serving.eagle3_gguf, `draftops export --format gguf`).

Unmarked: what llama.cpp's EAGLE-3 layer cannot compute is refused before the converter runs, and a missing llama.cpp
source tree or target folder is explained. Marked `llamacpp` (`make test-llamacpp` builds llama.cpp first): a feature
draft of the real SmolLM2 target goes through llama.cpp's own converter, reads back as the draft's weights, and
llama-server loads it beside the target's GGUF with `--spec-type draft-eagle3`, drafts with it and gives its
target-alone greedy output."""
from __future__ import annotations

import json

import pytest
import torch

from decode.models.feature_draft import feature_draft_from_target
from decode.serving.eagle3_gguf import check_convertible, check_eagle3_gguf
from decode.serving.export import GGUF, ExportError, draft_source, export_format, serving_commands, target_gguf
from decode.serving.gguf import GGUFExportError
from decode.serving.llamacpp import LlamaCppError, LlamaServer, converter_script, find_server
from decode.serving.speculators import save_speculators
from distill.register import export_draft
from pipeline.cli import main
from pipeline.config import load_config
from pipeline.sources import DEFAULT_TARGET, locate, resolve_model
from pipeline.traffic import DEFAULT_TRAFFIC, encode_prompts, first_per_category, load_traffic
from tests.families import tiny_family


def speculators_folder(path, family: str = "llama", **layer_changes):
    target = tiny_family(family, dtype=torch.float32)
    out = save_speculators(feature_draft_from_target(target), path, verifier_name_or_path="t")
    if layer_changes:
        config = json.loads((out / "config.json").read_text())
        config["transformer_layer_config"].update(layer_changes)
        (out / "config.json").write_text(json.dumps(config))
    return out


def test_what_llama_cpps_eagle3_layer_cannot_compute_is_refused(tmp_path):
    assert check_convertible(speculators_folder(tmp_path / "llama"))["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    check_convertible(speculators_folder(tmp_path / "llama3", "llama3"))  # llama3 rotary scaling: llama.cpp has it
    with pytest.raises(GGUFExportError, match="uses SiLU; this draft's MLP uses 'gelu_pytorch_tanh'"):
        check_convertible(speculators_folder(tmp_path / "gemma3", "gemma3"))
    with pytest.raises(GGUFExportError, match="rotary scaling 'yarn'"):
        check_convertible(speculators_folder(tmp_path / "yarn", rope_parameters={
            "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}))
    folder = speculators_folder(tmp_path / "two")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"eagle_aux_hidden_state_layer_ids": [2, 3]}))
    with pytest.raises(GGUFExportError, match=r"exactly three target layers; this draft reads \[2, 3\]"):
        check_convertible(folder)


def test_without_llama_cpps_source_or_the_target_folder_the_export_says_what_is_missing(tmp_path, monkeypatch,
                                                                                       capsys):
    target = tiny_family("qwen2", dtype=torch.float32)
    target.save_pretrained(tmp_path / "target")
    cfg = load_config(None, [f"target={tmp_path / 'target'}", "decode.gamma=3", "device=cpu"])
    export_draft(feature_draft_from_target(target), None, tmp_path / "draft", token_ids=None, cfg=cfg)
    draft = draft_source(str(tmp_path / "draft"))
    with pytest.raises(ExportError, match="needs the target's Hugging Face folder, llama.cpp's converter"):
        export_format(draft, GGUF, tmp_path / "a", target_dir=tmp_path / "target")
    with pytest.raises(ExportError, match="is not the target's Hugging Face folder"):
        export_format(draft, GGUF, tmp_path / "b", target_dir=tmp_path, converter=tmp_path / "convert_hf_to_gguf.py")
    assert not any((tmp_path / name).exists() for name in "ab")
    monkeypatch.setenv("DRAFTOPS_HOME", str(tmp_path / "home"))
    with pytest.raises(LlamaCppError, match="llama.cpp's own convert_hf_to_gguf.py.*build it first"):
        converter_script()
    assert main(["export", str(tmp_path / "draft"), "--format", "gguf", "--out", str(tmp_path / "c"),
                 "--target", str(tmp_path / "target")]) == 2
    assert "build it first" in capsys.readouterr().err and not (tmp_path / "c").exists()


@pytest.fixture(scope="module")
def eagle3(tmp_path_factory):
    """A feature draft of the real target (from its own weights, untrained: greedy identity does not depend on it),
    reduced to its 8192 first ids, exported as `make distill` does and then as an EAGLE-3 GGUF."""
    server = find_server()  # before the tests' own $DRAFTOPS_HOME hides the build
    if server is None:
        pytest.fail("no llama-server: `make test-llamacpp` builds it first (draftops llama-cpp build)")
    root = tmp_path_factory.mktemp("eagle3")
    target = resolve_model(DEFAULT_TARGET, device="cpu")
    draft = feature_draft_from_target(target.model, torch.arange(8192)).eval()
    cfg = load_config(None, [f"target={DEFAULT_TARGET}", "decode.gamma=4", "device=cpu"])
    export_draft(draft, target.tokenizer, root / "draft", token_ids=None, cfg=cfg)
    source = draft_source(str(root / "draft"))
    out = export_format(source, GGUF, root / "gguf", target_dir=locate(DEFAULT_TARGET).path,
                        converter=converter_script(), gguf_dtype="f16")
    other = feature_draft_from_target(target.model, torch.arange(1, 8193))  # another head: other rows, other d2t
    save_speculators(other, root / "other", verifier_name_or_path="t")
    requests = first_per_category(load_traffic(DEFAULT_TRAFFIC).split("heldout"), 1)[:2]
    prompts, _ = encode_prompts(requests, target.tokenizer, max_prompt_tokens=384)
    return {"root": root, "server": server, "draft": out / "draft-eagle3-f16.gguf", "source": source,
            "prompts": prompts}


@pytest.mark.llamacpp
def test_the_converter_writes_the_drafts_weights_and_llama_server_speculates_with_it(eagle3):
    assert [p.name for p in eagle3["draft"].parent.iterdir()] == ["draft-eagle3-f16.gguf"]
    check_eagle3_gguf(eagle3["draft"], eagle3["source"].path, "f16")  # as the export checked it
    with pytest.raises(GGUFExportError, match="is not the draft"):  # nor another draft's (its d2t first)
        check_eagle3_gguf(eagle3["draft"], eagle3["root"] / "other", "f16")
    target = target_gguf(DEFAULT_TARGET)
    with LlamaServer(target, binary=eagle3["server"], log=eagle3["root"] / "alone.log") as alone, \
            LlamaServer(target, draft=eagle3["draft"], draft_max=4, binary=eagle3["server"], spec_type="draft-eagle3",
                        log=eagle3["root"] / "eagle3.log") as spec:
        pairs = [(alone.complete(prompt, 24), spec.complete(prompt, 24)) for prompt in eagle3["prompts"]]
    assert all(len(reference.tokens) > 0 and result.tokens == reference.tokens for reference, result in pairs)
    assert sum(result.drafted for _, result in pairs) > 0
    assert "eagle3" in (eagle3["root"] / "eagle3.log").read_text().lower()
    printed = "\n".join(serving_commands("features", GGUF, eagle3["draft"].parent, DEFAULT_TARGET, 4))
    assert f"-md {eagle3['draft']} --spec-type draft-eagle3 --spec-draft-n-max 4" in printed

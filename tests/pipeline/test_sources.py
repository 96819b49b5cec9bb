import json
from pathlib import Path

import pytest
import torch

from pipeline.cli import main
from pipeline.families import supported_families
from pipeline.sources import (
    SourceError,
    TokenizerMismatch,
    check_tokenizer_compat,
    checkpoint_info,
    fingerprint_dir,
    locate,
    resolve_model,
    save_checkpoint,
)
from tests.conftest import make_tiny_model, make_tokenizer
from tests.families import TEXT, save_family


def test_local_checkpoint_resolves_with_a_stable_fingerprint(tiny_checkpoint):
    resolved = resolve_model(str(tiny_checkpoint), device="cpu")
    assert resolved.model.config.num_hidden_layers == 2 and resolved.token_ids is None
    assert resolved.fingerprint == fingerprint_dir(tiny_checkpoint) == locate(str(tiny_checkpoint)).fingerprint
    assert len(resolved.fingerprint) == 16


def test_fingerprint_changes_with_weights_not_with_software_version(tmp_path, tiny_tokenizer):
    a = save_checkpoint(make_tiny_model(len(tiny_tokenizer), seed=0), tiny_tokenizer, tmp_path / "a")
    b = save_checkpoint(make_tiny_model(len(tiny_tokenizer), seed=1), tiny_tokenizer, tmp_path / "b")
    assert fingerprint_dir(a) != fingerprint_dir(b)
    before = fingerprint_dir(a)
    config = json.loads((a / "config.json").read_text())
    config["transformers_version"] = "0.0.0"
    (a / "config.json").write_text(json.dumps(config))
    assert fingerprint_dir(a) == before


def test_reduced_vocabulary_draft_round_trips(tmp_path, tiny_tokenizer):
    model = make_tiny_model(len(tiny_tokenizer))
    token_ids = torch.tensor([0, 2, 5, 9, 11])
    model.config.tie_word_embeddings = False
    model.lm_head = torch.nn.Linear(64, len(token_ids), bias=False)
    out = save_checkpoint(model, tiny_tokenizer, tmp_path / "reduced", token_ids=token_ids)
    resolved = resolve_model(str(out), device="cpu")
    assert torch.equal(resolved.token_ids, token_ids)
    assert resolved.model.lm_head.weight.shape == (5, 64)
    assert torch.equal(resolved.model.lm_head.weight, model.lm_head.weight)
    logits = resolved.model(torch.tensor([[1, 3, 4]])).logits
    assert logits.shape == (1, 3, 5)
    info = checkpoint_info(locate(str(out)))
    assert info["draft_vocab_size"] == 5 and info["layers"] == 2 and info["hidden_size"] == 64


def test_unknown_sources_fail_clearly(tmp_path):
    with pytest.raises(SourceError, match="empty"):
        locate("")
    with pytest.raises(SourceError, match="GGUF file not found"):
        locate(str(tmp_path / "missing.gguf"))
    (tmp_path / "not_a_model").mkdir()
    with pytest.raises(SourceError, match="no config.json"):
        locate(str(tmp_path / "not_a_model"))
    with pytest.raises(SourceError, match="not in the MLflow registry"):
        locate("models:/nothing@champion")


def test_tokenizer_mismatch_names_the_first_differing_token():
    check_tokenizer_compat(make_tokenizer(), make_tokenizer())
    with pytest.raises(TokenizerMismatch, match=r"id 49: target has 'w0', draft has '\[UNK\]'"):
        check_tokenizer_compat(make_tokenizer(extra_words=3), make_tokenizer())


def test_a_damaged_fingerprint_cache_is_rebuilt_not_a_traceback(tiny_checkpoint, isolated_home):
    from pipeline import draftops_home
    from pipeline.sources import fingerprint_dir

    expected = fingerprint_dir(tiny_checkpoint)
    for damaged in ('{"truncated', "[1, 2]", "\x00\x01"):
        (draftops_home() / "fingerprints.json").write_text(damaged)
        assert fingerprint_dir(tiny_checkpoint) == expected
    assert json.loads((draftops_home() / "fingerprints.json").read_text())


def test_a_gguf_is_parsed_once_while_it_is_dequantized_and_gguf_is_restored_after(tmp_path):
    """`gguf_source._parsed_once`: the config's, tokenizer's and weights' reads of one file share one reader, and
    the name maps one build; outside it gguf's own functions are back."""
    import gguf

    from pipeline.gguf_source import _parsed_once

    writer = gguf.GGUFWriter(str(tmp_path / "v.gguf"), "llama")
    writer.add_token_list(["a", "b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with _parsed_once():
        first = gguf.GGUFReader(str(tmp_path / "v.gguf"))
        assert gguf.GGUFReader(str(tmp_path / "v.gguf")) is first
        assert isinstance(first, reader_class) and "tokenizer.ggml.tokens" in first.fields
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
    assert gguf.GGUFReader is reader_class and gguf.get_tensor_name_map is name_map


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
    assert resolve_model(phi3, device="cpu", dtype="float32").model.config.model_type == "phi3"

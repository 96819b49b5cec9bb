"""A layer draft as llama.cpp's GGUF (decode.serving.gguf, `draftops export --format gguf`): the rotary permutation by
hand, a round trip through transformers' GGUF loader that gives the draft's logits back (f32 to rounding, f16 close),
the target's vocabulary carried verbatim, the rotary base where transformers 5 keeps it, and refusals."""
from __future__ import annotations

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from decode.models.layer_draft import draft_from_target_layers, reduce_vocabulary
from decode.serving.export import ExportError, draft_source, export_format, serving_commands, target_gguf
from decode.serving.gguf import GGUFExportError, rope_base, rope_permute, write_llama_gguf
from distill.register import export_draft
from pipeline.cli import main
from pipeline.config import load_config
from pipeline.sources import load_checkpoint, save_checkpoint
from tests.conftest import make_tiny_model, make_tokenizer

IDS = torch.tensor([[1, 5, 9, 3, 7, 12, 30, 2, 44, 17]])


def vocabulary_gguf(path, tokens: list[str]):
    """A GGUF holding only a vocabulary (what the draft copies from its target's GGUF)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges(["a b", "ab c"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{{ messages }}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_draft(vocab: int, *, tied: bool, rope_theta: float = 50000.0, seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=tied, rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
                         initializer_range=0.2)
    return AutoModelForCausalLM.from_config(config).eval()


def fields(path) -> dict:
    reader = gguf.GGUFReader(path)
    return {key: field.contents() for key, field in reader.fields.items()}


def test_rope_permute_pairs_each_heads_halves_as_adjacent_rows():
    # one head of 4 rows: Hugging Face rotates row i with row i + 2, GGUF rotates rows 2i and 2i + 1 together
    assert rope_permute(torch.arange(4.0)[:, None], heads=1).flatten().tolist() == [0, 2, 1, 3]
    # two heads of 4 rows each, two columns: permuted within each head
    weight = torch.arange(16.0).reshape(8, 2)
    assert rope_permute(weight, heads=2)[:, 0].tolist() == [0, 4, 2, 6, 8, 12, 10, 14]


@torch.no_grad()
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_gguf_read_back_by_transformers_gives_the_drafts_logits(tmp_path, tied):
    model = tiny_draft(128, tied=tied)
    vocabulary = vocabulary_gguf(tmp_path / "vocab.gguf", [f"t{i}" for i in range(128)])
    out = write_llama_gguf(model.state_dict(), model.config, vocabulary, tmp_path / "d.gguf", dtype="f32")
    back = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="d.gguf", dtype=torch.float32).eval()
    assert back.config.rope_parameters["rope_theta"] == 50000.0
    torch.testing.assert_close(back(IDS).logits, model(IDS).logits, atol=1e-5, rtol=1e-5)

    read = fields(out)
    vocab = fields(vocabulary)
    assert {k: v for k, v in read.items() if k.startswith("tokenizer.")} == {
        k: v for k, v in vocab.items() if k.startswith("tokenizer.")}
    assert (read["llama.block_count"], read["llama.rope.freq_base"], read["llama.attention.head_count_kv"]) == (
        2, 50000.0, 2)
    names = {t.name: t for t in gguf.GGUFReader(out).tensors}
    assert ("output.weight" in names) is not tied
    assert names["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32


@torch.no_grad()
def test_f16_keeps_norms_in_f32_and_the_logits_within_rounding(tmp_path):
    model = tiny_draft(128, tied=False, seed=1)
    vocabulary = vocabulary_gguf(tmp_path / "vocab.gguf", [f"t{i}" for i in range(128)])
    out = write_llama_gguf(model.state_dict(), model.config, vocabulary, tmp_path / "d.gguf", dtype="f16")
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(out).tensors}
    assert types["blk.1.ffn_down.weight"] == types["token_embd.weight"] == gguf.GGMLQuantizationType.F16
    assert types["output_norm.weight"] == gguf.GGMLQuantizationType.F32
    back = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="d.gguf", dtype=torch.float32).eval()
    want, got = model(IDS).logits, back(IDS).logits
    assert 0 < float((want - got).abs().max()) < 1e-2 * float(want.abs().max())


@torch.no_grad()
def test_q8_0_quantizes_matrices_in_blocks_of_32_and_stays_close(tmp_path):
    model = tiny_draft(128, tied=True, seed=2)
    vocabulary = vocabulary_gguf(tmp_path / "vocab.gguf", [f"t{i}" for i in range(128)])
    out = write_llama_gguf(model.state_dict(), model.config, vocabulary, tmp_path / "d.gguf", dtype="q8_0")
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(out).tensors}
    assert types["blk.0.attn_q.weight"] == types["token_embd.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["output_norm.weight"] == gguf.GGMLQuantizationType.F32
    assert fields(out)["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    back = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="d.gguf", dtype=torch.float32).eval()
    q8 = gguf.GGMLQuantizationType.Q8_0
    for weight in (p for p in model.parameters() if p.ndim == 2):  # each row's blocks of 32 rounded as Q8_0 rounds
        weight.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(weight.numpy(), q8), q8)))
    torch.testing.assert_close(back(IDS).logits, model(IDS).logits, atol=1e-4, rtol=1e-4)


def test_refusals(tmp_path):
    model = tiny_draft(128, tied=False)
    vocabulary = vocabulary_gguf(tmp_path / "vocab.gguf", [f"t{i}" for i in range(100)])
    with pytest.raises(GGUFExportError, match="100 tokens, the draft's vocab_size is 128"):
        write_llama_gguf(model.state_dict(), model.config, vocabulary, tmp_path / "d.gguf")
    with pytest.raises(GGUFExportError, match="unknown GGUF dtype 'q4'"):
        write_llama_gguf(model.state_dict(), model.config, vocabulary, tmp_path / "d.gguf", dtype="q4")
    scaled = LlamaConfig(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(GGUFExportError, match="rotary scaling 'linear' is not exported"):
        rope_base(scaled)
    assert rope_base(LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 1e5})) == 1e5


@pytest.fixture(scope="module")
def layer_draft(tmp_path_factory):
    """A tiny target with a vocabulary GGUF beside it, and a reduced-head one-layer draft of it as `make distill`
    exports it."""
    root = tmp_path_factory.mktemp("gguf_export")
    tokenizer = make_tokenizer(extra_words=20)
    target = make_tiny_model(len(tokenizer), seed=0)
    save_checkpoint(target, tokenizer, root / "target")
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    target_file = vocabulary_gguf(root / "target.gguf", vocab)
    cfg = load_config(None, [f"target={target_file}", "decode.gamma=3", "device=cpu"])
    token_ids = torch.tensor(sorted({0, 1, 2} | set(range(3, len(tokenizer), 3))))
    draft = draft_from_target_layers(target, [1])
    reduce_vocabulary(draft, token_ids, target.lm_head.weight)
    export_draft(draft.eval(), tokenizer, root / "draft", token_ids=token_ids, cfg=cfg)
    return {"root": root, "target_gguf": target_file, "token_ids": token_ids, "vocab": len(tokenizer)}


@torch.no_grad()
def test_export_writes_the_full_vocabulary_copy_under_the_targets_vocabulary(layer_draft, tmp_path):
    draft = draft_source(str(layer_draft["root"] / "draft"))
    out = export_format(draft, "gguf", tmp_path / "gguf", vocabulary=target_gguf(draft.target), gguf_dtype="f32")
    assert [p.name for p in out.iterdir()] == ["draft-f32.gguf"]
    back = AutoModelForCausalLM.from_pretrained(out, gguf_file="draft-f32.gguf", dtype=torch.float32).eval()
    kept = load_checkpoint(layer_draft["root"] / "draft").float().eval()(IDS).logits
    full = back(IDS).logits
    assert full.shape[-1] == layer_draft["vocab"]
    torch.testing.assert_close(full[..., layer_draft["token_ids"]], kept, atol=1e-5, rtol=1e-5)
    assert fields(out / "draft-f32.gguf")["tokenizer.ggml.tokens"] == fields(layer_draft["target_gguf"])[
        "tokenizer.ggml.tokens"]


def test_the_gguf_format_needs_the_targets_gguf(layer_draft, tmp_path, capsys):
    with pytest.raises(ExportError, match="is not one: give --target FILE.gguf"):
        target_gguf(str(layer_draft["root"] / "target"))
    assert target_gguf("smollm2-135m-instruct").name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    source = str(layer_draft["root"] / "draft")
    assert main(["export", source, "--format", "gguf", "--out", str(tmp_path / "a"), "--target",
                 str(layer_draft["root"] / "target")]) == 2
    assert "--target FILE.gguf" in capsys.readouterr().err
    assert main(["export", source, "--format", "gguf", "--out", str(tmp_path / "b")]) == 0
    printed = capsys.readouterr().out
    assert (f"llama-server -m {layer_draft['target_gguf']} -md {tmp_path / 'b' / 'draft-f16.gguf'} --spec-type "
            "draft-simple --spec-draft-n-max 3 --spec-draft-n-min 0 --metrics") in printed
    assert serving_commands("layers", "gguf", tmp_path / "b", str(layer_draft["target_gguf"]), 4)[1].count(
        "--spec-draft-n-max 4") == 1


def test_a_broken_gguf_is_caught_by_the_read_back(layer_draft, tmp_path, monkeypatch):
    import decode.serving.gguf as gguf_format

    swapped = {**gguf_format.LAYER_TENSORS, "mlp.gate_proj.weight": "ffn_up.weight",
               "mlp.up_proj.weight": "ffn_gate.weight"}
    monkeypatch.setattr(gguf_format, "LAYER_TENSORS", swapped)  # a tensor written under the wrong name
    draft = draft_source(str(layer_draft["root"] / "draft"))
    with pytest.raises(ExportError, match="read back, its logits differ from the draft's"):
        export_format(draft, "gguf", tmp_path / "g", vocabulary=layer_draft["target_gguf"])
    assert not (tmp_path / "g").exists() and list(tmp_path.iterdir()) == []

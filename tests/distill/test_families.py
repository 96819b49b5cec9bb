"""Drafts from every supported family (tests.families: random weights, built from transformers' configs): the layer
draft and the feature draft trained on the logits they decode with, distilled for two steps, evaluated, registered,
decoded greedily as the target alone decodes (chains and token trees), and exported in every format that applies,
each loaded back.

One module-scoped job pair per family (one MLflow store for all) keeps the file to about a minute on two cores."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from decode.models.architectures import head_logits
from decode.models.feature_draft import FeatureDraft, feature_draft_from_target
from decode.models.layer_draft import draft_from_target_layers, full_vocab_copy, reduce_vocabulary
from decode.runtime.forward import ModelRunner, greedy_decode, target_features
from decode.serving.export import GGUF, HF, SPECULATORS, VLLM, ExportError, draft_source, export_format
from decode.serving.speculators import load_speculators
from distill.step import FeatureStepLogits, ResponseLogits, step_mask
from tests.families import FAMILIES, tiny_family

SEQ = torch.tensor([[1, 5, 9, 3, 7, 7, 4, 12, 30, 2], [1, 8, 4, 6, 2, 9, 3, 0, 0, 0]])
MASK = torch.tensor([[1] * 10, [1] * 7 + [0] * 3])
REDUCED = torch.arange(0, 128, 3)


def response_mask() -> torch.Tensor:
    loss_mask = torch.zeros(2, 10, dtype=torch.bool)
    loss_mask[0, 4:9], loss_mask[1, 2:6] = True, True
    return loss_mask


@torch.no_grad()
@pytest.mark.parametrize("reduced", [False, True], ids=["full", "reduced"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_layer_drafts_training_logits_are_its_decoding_logits(family, reduced):
    """ResponseLogits (what the loss scores) against the decoder's own forward of each row, position by position:
    Gemma 2's final soft-capping, Gemma's embedding scale and tied heads included; a reduced head leaves the target's
    embeddings and tie as they were."""
    target = tiny_family(family)
    embeddings = target.get_input_embeddings().weight.clone()
    draft = draft_from_target_layers(target, [0, 3]).eval()
    if reduced:
        reduce_vocabulary(draft, REDUCED, target.get_output_embeddings().weight.detach())
    assert torch.equal(target.get_input_embeddings().weight, embeddings)
    assert (target.get_output_embeddings().weight is target.get_input_embeddings().weight) == bool(
        target.config.tie_word_embeddings)
    assert draft.get_input_embeddings().weight.data_ptr() != target.get_input_embeddings().weight.data_ptr()
    loss_mask = response_mask()
    trained = ResponseLogits(draft)(SEQ, MASK, loss_mask)
    runner = ModelRunner(draft)
    decoded = [runner.forward(SEQ[b, : int(MASK[b].sum())], runner.new_cache(), 0, False) for b in range(2)]
    expected = torch.cat([decoded[b][loss_mask[b, : len(decoded[b])]] for b in range(2)])
    torch.testing.assert_close(trained, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head_logits(draft, draft.model(SEQ[:1]).last_hidden_state), draft(SEQ[:1]).logits,
                               atol=1e-5, rtol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("family", FAMILIES)
def test_a_feature_drafts_training_logits_are_its_decoding_logits(family):
    """FeatureStepLogits (training-time test, 2 steps) against `FeatureDraft.step` as decoding feeds it: the verified
    prefix's features, then its own output for the next token."""
    target = tiny_family(family)
    draft = feature_draft_from_target(target, REDUCED).eval()
    assert draft.feature_layers == (1, 2, 3) and draft.config.model_type == "llama"
    features = target_features(target(input_ids=SEQ[:1], output_hidden_states=True).hidden_states,
                               draft.feature_layers)
    loss_mask = torch.zeros(1, 10, dtype=torch.bool)
    loss_mask[0, 3:9] = True
    per_step = FeatureStepLogits(draft, steps=2)(features, SEQ[:1], MASK[:1], loss_mask)
    for i in (2, 5):  # index i predicts token i + 2 (step 0) and i + 3 (step 1), both response tokens
        cache = draft.new_cache()
        out = draft.step(draft.fuse(features[0, : i + 1]), SEQ[0, 1 : i + 2], cache, 0, torch.arange(1, i + 2))[-1:]
        second = draft.step(out, SEQ[0, i + 2][None], cache, i + 1, torch.tensor([i + 2]))
        for j, hidden in enumerate((out, second)):
            row = int(step_mask(loss_mask, j)[0, :i].sum())  # step j's rows are its masked indices, in order
            torch.testing.assert_close(per_step[j][row], draft.logits(hidden)[0], atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module", params=FAMILIES)
def jobs(request, tmp_path_factory, _migrated_mlflow_db):
    """A random-weight target of the family, and a layer draft and a feature draft distilled from it for two steps
    (responses generated once), each evaluated and registered in one shared MLflow store."""
    from distill.train import run_distill
    from pipeline.sources import save_checkpoint
    from tests.conftest import make_tokenizer
    from tests.distill.tiny_job import tiny_config

    family, root = request.param, tmp_path_factory.mktemp(request.param)
    store = tmp_path_factory.getbasetemp() / "families-mlflow.db"
    if not store.exists():
        shutil.copy(_migrated_mlflow_db, store)
    tokenizer = make_tokenizer(extra_words=40)
    save_checkpoint(tiny_family(family, vocab_size=len(tokenizer), dtype=torch.float32), tokenizer, root / "target")
    results = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DRAFTOPS_HOME", str(root / "home"))
        torch.set_num_threads(1)
        for kind in ("layers", "features"):
            cfg = tiny_config(root, f"distill.family={kind}", "distill.max_steps=2", "distill.eval_every=2",
                              "distill.ttt_steps=2", "decode.gamma=3", "distill.responses_per_prompt=1",
                              "distill.max_new_tokens=8", "distill.eval_prompts=4", f"tracking.uri=sqlite:///{store}",
                              f"tracking.registered_model=draft-{family}-{kind}", f"distill.output_dir={root}/{kind}")
            results[kind] = (cfg, run_distill(cfg))
    return {"family": family, "root": root, "tokenizer": tokenizer, **results}


def check_job(cfg, result, family: str) -> None:
    assert len(result.history) == 2 and [e["step"] for e in result.evals] == [2]
    assert torch.isfinite(torch.tensor([h["loss"] for h in result.history])).all()
    assert 0 <= result.metrics["alpha_t0"] <= 1 and result.metrics["tau_t0"] >= 1
    assert (result.version, result.alias) == ("1", "champion"), family


def greedy_identity(cfg, source: str, *, trees: bool) -> None:
    """The draft loaded back (as `draftops decode` loads it) decodes, in chains or in token trees, the target's greedy
    output."""
    from decode.factory import build_decoder
    from decode.serving.loading import load_draft, load_model
    from pipeline.config import DecodeConfig

    target = load_model(cfg.target, device="cpu", cpu_linear="torch")
    draft = load_draft(source, target, cpu_linear="torch")
    prompt = target.tokenizer("the cat sat on", add_special_tokens=False)["input_ids"]
    decode = DecodeConfig(gamma=3, suffix=False, **{"tree_budget": 6} if trees else {"tree_budget_schedule": None})
    decoder = build_decoder(target, draft, decode)
    expected = greedy_decode(ModelRunner(target.model), prompt, 12, decoder.eos_token_ids)
    assert decoder.generate(prompt, max_new_tokens=12).token_ids == expected


def test_both_distilled_drafts_decode_the_targets_greedy_output_in_token_trees(jobs):
    for kind in ("layers", "features"):
        cfg, result = jobs[kind]
        greedy_identity(cfg, str(result.export_dir), trees=True)


@torch.no_grad()
def test_a_layer_draft_distills_decodes_and_exports_as_hf_vllm_and_gguf(jobs, tmp_path):
    from pipeline.sources import load_checkpoint
    from tests.decode.serving.test_gguf import vocabulary_gguf

    family, (cfg, result) = jobs["family"], jobs["layers"]
    check_job(cfg, result, family)
    assert result.token_ids is not None  # a reduced head, exported with its full-vocabulary copy
    greedy_identity(cfg, str(result.export_dir), trees=False)
    vocab, source = len(jobs["tokenizer"]), draft_source(str(result.export_dir))
    kept = load_checkpoint(result.export_dir).eval()(SEQ).logits
    for fmt in (HF, VLLM):
        out = export_format(source, fmt, tmp_path / fmt, target_vocab_size=vocab)
        assert json.loads((out / "config.json").read_text())["model_type"] == kept_type(family)
        full = AutoModelForCausalLM.from_pretrained(out).eval()(SEQ).logits
        torch.testing.assert_close(full[..., result.token_ids], kept, atol=1e-5, rtol=1e-5)
    vocabulary = vocabulary_gguf(tmp_path / "target.gguf", jobs["tokenizer"].convert_ids_to_tokens(range(vocab)))
    if family == "llama":  # read back through transformers' GGUF loader inside, to the copy's logits
        out = export_format(source, GGUF, tmp_path / "gguf", vocabulary=vocabulary, gguf_dtype="f32")
        assert [p.name for p in out.iterdir()] == ["draft-f32.gguf"]
    else:
        why = "rotary scaling 'llama3'" if family == "llama3" else f"model type '{kept_type(family)}'"
        with pytest.raises(ExportError, match=why):
            export_format(source, GGUF, tmp_path / "gguf", vocabulary=vocabulary)
        assert not (tmp_path / "gguf").exists()


def kept_type(family: str) -> str:
    return {"llama3": "llama", "gemma3": "gemma3_text"}.get(family, family)


@torch.no_grad()
def test_a_feature_draft_distills_decodes_and_exports_as_speculators_and_vllm(jobs, tmp_path):
    """The speculators folder loads back into draftops and into `speculators` itself, which computes the same
    training-time-test logits over the target's features."""
    speculators = pytest.importorskip("speculators")
    family, (cfg, result) = jobs["family"], jobs["features"]
    check_job(cfg, result, family)
    greedy_identity(cfg, str(result.export_dir), trees=False)
    target = AutoModelForCausalLM.from_pretrained(cfg.target).eval()
    ours = load_speculators(result.export_dir, target)
    assert isinstance(ours, FeatureDraft) and ours.feature_layers == (1, 2, 3)
    source = draft_source(str(result.export_dir))
    for fmt in (SPECULATORS, VLLM):
        export_format(source, fmt, tmp_path / fmt, target_vocab_size=len(jobs["tokenizer"]))
    with pytest.raises(ExportError, match="feature draft"):
        export_format(source, HF, tmp_path / "hf")
    layer = json.loads((tmp_path / VLLM / "config.json").read_text())["transformer_layer_config"]
    assert (layer["model_type"], layer["num_hidden_layers"]) == ("llama", 1)

    config = speculators.Eagle3SpeculatorConfig.from_pretrained(tmp_path / SPECULATORS)
    config.transformer_layer_config._attn_implementation = "eager"
    theirs = speculators.SpeculatorModel.from_pretrained(tmp_path / SPECULATORS, config=config).eval()
    theirs.embed_tokens.weight.copy_(target.get_input_embeddings().weight)  # as tests/decode/serving/test_speculators
    logits = []
    theirs.lm_head.register_forward_hook(lambda module, args, output: logits.append(output[0]))
    seq = SEQ[:1]
    features = target_features(target(input_ids=seq, output_hidden_states=True).hidden_states, ours.feature_layers)
    input_ids = torch.cat([seq[0, 1:], seq.new_zeros(1)])[None]  # index i reads token i + 1, as in FeatureDraft
    theirs(hidden_states=features, input_ids=input_ids, document_ids=torch.zeros_like(input_ids), ttt_steps=2)
    unrolled = ours.unroll(features, seq, torch.ones_like(seq), 2)
    for hidden, their in zip(unrolled, logits, strict=True):
        torch.testing.assert_close(their, ours.logits(hidden)[0], atol=1e-4, rtol=1e-4)


def test_full_vocab_copy_of_a_tied_family_scores_the_kept_ids():
    """Gemma 2 (tied head, soft-capped logits): the HF copy of a reduced draft gives the draft's logits at the kept
    ids and leaves the draft's embeddings as they were."""
    target = tiny_family("gemma2")
    draft = draft_from_target_layers(target, [1]).eval()
    reduce_vocabulary(draft, REDUCED, target.get_output_embeddings().weight.detach())
    embeddings = draft.get_input_embeddings().weight.clone()
    full = full_vocab_copy(draft, REDUCED)
    with torch.no_grad():
        torch.testing.assert_close(full(SEQ).logits[..., REDUCED], draft(SEQ).logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(draft.get_input_embeddings().weight, embeddings)
    assert torch.equal(full.get_input_embeddings().weight, embeddings)

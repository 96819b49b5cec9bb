"""The speculators Eagle3 format (decode.serving.speculators): a feature draft comes back from disk computing the same,
its vocabulary maps follow speculators' conventions, wrong folders and targets are refused, and `speculators` itself
loads the export and computes the same logits."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from decode.models.feature_draft import FeatureDraft
from decode.runtime.forward import target_features
from decode.serving.speculators import is_speculators_dir, load_speculators, save_speculators, vocab_maps
from tests.conftest import make_tiny_model

VOCAB = 40
LAYERS = (0, 2, 3)  # distinct and in order, as servers capture them (the 4-layer default (2, 2, 1) is not)
SEQ = torch.tensor([1, 5, 9, 3, 7, 7, 4, 12, 30, 2])
REDUCED = torch.tensor([0, 3, 4, 9, 12, 20, 39])


@pytest.fixture(scope="module")
def target():
    return make_tiny_model(VOCAB, seed=3, layers=4)


def random_draft(target, token_ids=None, feature_layers=LAYERS, norm_before_residual=False,
                 intermediate_size=None) -> FeatureDraft:
    """Every own parameter moved off its initial value, so a weight the format drops or swaps shows up."""
    torch.manual_seed(1)
    draft = FeatureDraft(target.config, target.get_input_embeddings(), feature_layers=feature_layers,
                         token_ids=token_ids, norm_before_residual=norm_before_residual,
                         intermediate_size=intermediate_size)
    with torch.no_grad():
        for name, parameter in draft.named_parameters():
            if not name.startswith("embed_tokens"):
                parameter.add_(0.3 * torch.randn_like(parameter))
        draft.lm_head.weight.mul_(8)
    return draft.eval()


def own_state(draft: FeatureDraft) -> dict:
    return {k: v for k, v in draft.state_dict().items() if k != "embed_tokens.weight"}


def unrolled(draft: FeatureDraft, target, steps: int = 3) -> list[torch.Tensor]:
    features = target_features(target(input_ids=SEQ[None], output_hidden_states=True).hidden_states,
                               draft.feature_layers)
    return [draft.logits(h) for h in draft.unroll(features, SEQ[None], torch.ones(1, len(SEQ), dtype=torch.long),
                                                  steps)]


@torch.no_grad()
@pytest.mark.parametrize("token_ids", [None, REDUCED], ids=["full", "reduced"])
def test_round_trip_gives_the_same_weights_and_the_same_unrolled_logits(target, tmp_path, token_ids):
    draft = random_draft(target, token_ids)
    out = save_speculators(draft, tmp_path / "spec", verifier_name_or_path="org/tiny-llama",
                           verifier_architectures=["LlamaForCausalLM"], speculative_tokens=4)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec"]  # the temporary sibling was swapped in
    loaded = load_speculators(out, target)
    assert loaded.embed_tokens is target.get_input_embeddings()
    assert loaded.feature_layers == LAYERS
    assert (loaded.token_ids is None) == (token_ids is None)
    if token_ids is not None:
        assert torch.equal(loaded.token_ids, token_ids)
    ours, theirs = own_state(draft), own_state(loaded)
    assert ours.keys() == theirs.keys()
    for name, value in ours.items():
        assert torch.equal(theirs[name], value), name
    for a, b in zip(unrolled(draft, target), unrolled(loaded, target)):
        assert torch.equal(a, b)

    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert config["draft_vocab_size"] == (VOCAB if token_ids is None else len(token_ids))
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]
    assert config["norm_before_residual"] is False and config["target_hidden_size"] == 64
    layer = config["transformer_layer_config"]
    assert (layer["model_type"], layer["num_hidden_layers"], layer["vocab_size"], layer["hidden_size"]) == (
        "llama", 1, VOCAB, 64)
    assert layer["tie_word_embeddings"] is False  # the target's ties its head; the draft's own head is separate
    assert config["speculators_config"] == {
        "algorithm": "eagle3", "default_proposal_method": "greedy",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 4}],
        "verifier": {"name_or_path": "org/tiny-llama", "architectures": ["LlamaForCausalLM"]}}
    assert "embed_tokens.weight" not in load_file(out / "model.safetensors")


@torch.no_grad()
def test_a_wider_mlp_is_saved_in_the_layer_config_and_comes_back(target, tmp_path):
    draft = random_draft(target, REDUCED, intermediate_size=3 * target.config.intermediate_size)
    out = save_speculators(draft, tmp_path / "wide", verifier_name_or_path="t")
    layer = json.loads((out / "config.json").read_text())["transformer_layer_config"]
    assert layer["intermediate_size"] == 3 * target.config.intermediate_size
    loaded = load_speculators(out, target)
    assert loaded.layer.mlp.up_proj.weight.shape == draft.layer.mlp.up_proj.weight.shape
    for a, b in zip(unrolled(draft, target), unrolled(loaded, target)):
        assert torch.equal(a, b)


def test_vocabulary_maps_are_speculators_offsets_and_mask(target, tmp_path):
    d2t, t2d = vocab_maps(torch.tensor([0, 3, 4, 9]), 10)
    assert d2t.dtype == torch.int64 and d2t.tolist() == [0, 2, 2, 6]  # target id = draft row + d2t[row]
    assert t2d.dtype == torch.bool and t2d.tolist() == [True, False, False, True, True] + [False] * 4 + [True]

    save_speculators(random_draft(target, REDUCED), tmp_path / "reduced", verifier_name_or_path="t")
    tensors = load_file(tmp_path / "reduced" / "model.safetensors")
    assert tensors["d2t"].tolist() == [0, 2, 2, 6, 8, 15, 33]
    assert tensors["t2d"].nonzero().flatten().tolist() == REDUCED.tolist() and tensors["t2d"].shape == (VOCAB,)
    save_speculators(random_draft(target), tmp_path / "full", verifier_name_or_path="t")
    assert not {"d2t", "t2d"} & load_file(tmp_path / "full" / "model.safetensors").keys()  # as speculators saves it


def test_rewriting_a_folder_replaces_it_whole(target, tmp_path):
    save_speculators(random_draft(target, REDUCED), tmp_path / "spec", verifier_name_or_path="t")
    save_speculators(random_draft(target), tmp_path / "spec", verifier_name_or_path="t")
    assert load_speculators(tmp_path / "spec", target).token_ids is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec"]


def test_the_verifier_architectures_default_to_the_targets(tmp_path):
    target = make_tiny_model(VOCAB, seed=3, layers=4)
    target.config.architectures = ["LlamaForCausalLM"]
    save_speculators(random_draft(target), tmp_path / "spec", verifier_name_or_path="t")
    verifier = json.loads((tmp_path / "spec" / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": "t", "architectures": ["LlamaForCausalLM"]}


@torch.no_grad()
def test_a_bf16_target_gets_a_bf16_draft_over_its_own_embeddings(tmp_path):
    target = make_tiny_model(VOCAB, seed=3, layers=4).to(torch.bfloat16)
    save_speculators(random_draft(target), tmp_path / "spec", verifier_name_or_path="t")
    loaded = load_speculators(tmp_path / "spec", target)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    assert loaded.embed_tokens is target.get_input_embeddings()
    assert loaded.rotary_emb.inv_freq.dtype == torch.float32
    assert unrolled(loaded, target, steps=1)[0].dtype == torch.bfloat16


def test_unservable_feature_layers_and_token_counts_are_refused(target, tmp_path):
    with pytest.raises(ValueError, match="not strictly increasing"):
        save_speculators(random_draft(target, feature_layers=(2, 2, 1)), tmp_path / "s", verifier_name_or_path="t")
    with pytest.raises(ValueError, match="speculative_tokens"):
        save_speculators(random_draft(target), tmp_path / "s", verifier_name_or_path="t", speculative_tokens=0)
    assert not (tmp_path / "s").exists()


def test_wrong_folders_and_targets_are_refused(target, tmp_path):
    out = save_speculators(random_draft(target, REDUCED), tmp_path / "spec", verifier_name_or_path="t")
    assert is_speculators_dir(out)
    assert not is_speculators_dir(tmp_path / "missing")
    target.save_pretrained(tmp_path / "plain")
    assert not is_speculators_dir(tmp_path / "plain")
    with pytest.raises(ValueError, match="not a speculators export"):
        load_speculators(tmp_path / "plain", target)
    with pytest.raises(ValueError, match="not a speculators export"):
        load_speculators(tmp_path / "missing", target)
    with pytest.raises(ValueError, match="hidden size mismatch"):
        load_speculators(out, make_tiny_model(VOCAB, seed=3, layers=4, hidden=32))
    with pytest.raises(ValueError, match="vocab mismatch"):
        load_speculators(out, make_tiny_model(VOCAB + 8, seed=3, layers=4))
    with pytest.raises(ValueError, match="reads target layers"):
        load_speculators(out, make_tiny_model(VOCAB, seed=3, layers=3))

    config = json.loads((out / "config.json").read_text())
    for change, message in [({"speculators_model_type": "mtp"}, "not eagle3"),
                            ({"norm_output": True}, "does not compute"),
                            ({"draft_vocab_size": 8}, "disagree")]:
        (out / "config.json").write_text(json.dumps(config | change))
        with pytest.raises(ValueError, match=message):
            load_speculators(out, target)


@torch.no_grad()
@pytest.mark.parametrize(("token_ids", "norm_before_residual"), [(None, False), (REDUCED, False), (REDUCED, True)],
                         ids=["full", "reduced", "norm_before_residual"])
def test_speculators_loads_the_export_and_computes_the_same_logits(target, tmp_path, token_ids, norm_before_residual):
    """`speculators`' own loader takes every saved weight, and with the target's embeddings its training forward over
    3 steps gives the logits `FeatureDraft.unroll` gives, index for index (also with its trainer's default
    norm_before_residual, which draftops reads back as it is)."""
    speculators = pytest.importorskip("speculators")
    target.save_pretrained(tmp_path / "target")
    draft = random_draft(target, token_ids, norm_before_residual=norm_before_residual)
    out = save_speculators(draft, tmp_path / "spec", verifier_name_or_path=str(tmp_path / "target"))

    config = speculators.Eagle3SpeculatorConfig.from_pretrained(out)
    assert (config.draft_vocab_size, config.eagle_aux_hidden_state_layer_ids) == (draft.lm_head.out_features,
                                                                                  list(LAYERS))
    assert config.norm_before_residual is norm_before_residual
    assert load_speculators(out, target).norm_before_residual is norm_before_residual
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention's blocks outsize tiny sequences
    model = speculators.SpeculatorModel.from_pretrained(out, config=config).eval()
    assert isinstance(model, speculators.Eagle3DraftModel)
    state = model.state_dict()
    for name, value in own_state(draft).items():
        assert torch.equal(state[name], value), name
    # the export leaves the embeddings to the verifier; speculators 0.9.0 under transformers 5 fetches them only when
    # its uninitialised (not NaN-filled) tensor happens to hold a NaN, so they are handed over as its loader means to
    model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    ignored = {"embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight"}
    assert state.keys() - own_state(draft).keys() - ignored == (set() if token_ids is None else {"d2t", "t2d"})
    if token_ids is not None:
        assert torch.equal(model.d2t + torch.arange(len(token_ids)), token_ids)

    logits = []
    model.lm_head.register_forward_hook(lambda module, args, output: logits.append(output[0]))
    features = target_features(target(input_ids=SEQ[None], output_hidden_states=True).hidden_states, LAYERS)
    input_ids = torch.cat([SEQ[1:], SEQ.new_zeros(1)])[None]  # index i reads token i+1, as in FeatureDraft
    model(hidden_states=features, input_ids=input_ids, document_ids=torch.zeros_like(input_ids), ttt_steps=3)
    for ours, theirs in zip(unrolled(draft, target), logits, strict=True):
        torch.testing.assert_close(theirs, ours[0], atol=1e-4, rtol=1e-4)

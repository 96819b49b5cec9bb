import pytest
import torch

from decode.models.layer_draft import draft_from_target_layers, frequent_token_ids, full_vocab_copy
from distill.init import draft_from_config, init_draft
from pipeline.config import DistillConfig
from pipeline.sources import TokenizerMismatch, save_checkpoint
from tests.conftest import make_tiny_model, make_tokenizer

IDS = torch.tensor([[1, 5, 9, 12, 40, 3, 7, 2]])


@pytest.fixture(scope="module")
def target():
    return make_tiny_model(64, seed=0)


def test_frequent_token_ids_keeps_the_most_frequent_and_the_special_ids():
    responses = [[5, 5, 7, 9], [7, 5, 11], [9, 11, 11, 42]]  # counts: 5:3, 11:3, 7:2, 9:2, 42:1
    assert frequent_token_ids(responses, 2, special_ids=[0, 2]).tolist() == [0, 2, 5, 11]
    assert frequent_token_ids(responses, 3, special_ids=[2]).tolist() == [2, 5, 7, 11]  # tie 7/9: lower id first
    assert frequent_token_ids(responses, 100, special_ids=[]).tolist() == [5, 7, 9, 11, 42]


def test_all_layers_of_the_target_reproduce_it_exactly(target):
    draft = draft_from_target_layers(target, [0, 1]).eval()
    torch.testing.assert_close(draft(IDS).logits, target(IDS).logits, rtol=0, atol=0)


def test_layer_subset_copies_the_chosen_layers(target):
    draft = draft_from_target_layers(target, [1])
    assert draft.config.num_hidden_layers == 1
    for name, value in draft.model.layers[0].state_dict().items():
        assert torch.equal(value, target.model.layers[1].state_dict()[name]), name
    assert torch.equal(draft.model.norm.weight, target.model.norm.weight)
    assert torch.equal(draft.lm_head.weight, target.lm_head.weight)
    with pytest.raises(ValueError, match="init_layers"):
        draft_from_target_layers(target, [2])


def test_reduced_vocab_head_holds_the_target_rows_untied(target):
    token_ids = torch.tensor([0, 1, 2, 5, 9, 40])
    cfg = DistillConfig(init="target_layers", init_layers=[0, 1])
    draft = init_draft(cfg, target, token_ids=token_ids).eval()
    assert draft.lm_head.out_features == 6
    assert torch.equal(draft.lm_head.weight, target.lm_head.weight[token_ids])
    assert draft.lm_head.weight.data_ptr() != draft.model.embed_tokens.weight.data_ptr()
    assert draft.config.tie_word_embeddings is False
    torch.testing.assert_close(draft(IDS).logits, target(IDS).logits[..., token_ids])


def test_random_init_from_config_overrides(target):
    cfg = DistillConfig(init="config", init_config={"num_hidden_layers": 1, "intermediate_size": 32})
    torch.manual_seed(0)
    draft = init_draft(cfg, target)
    assert draft.config.num_hidden_layers == 1 and draft.config.intermediate_size == 32
    assert draft.config.vocab_size == target.config.vocab_size
    assert not torch.equal(draft.model.embed_tokens.weight, target.model.embed_tokens.weight)
    with pytest.raises(ValueError, match="no key 'hidden_layerz'"):
        draft_from_config(target, {"hidden_layerz": 1})


def test_init_from_a_saved_checkpoint(tmp_path, target):
    tokenizer = make_tokenizer()
    token_ids = torch.tensor([0, 1, 2, 7, 8])
    small = make_tiny_model(len(tokenizer), seed=3)
    reduced = init_draft(DistillConfig(init="target_layers", init_layers=[1]), small, token_ids=token_ids)
    path = save_checkpoint(reduced, tokenizer, tmp_path / "reduced", token_ids=token_ids)
    cfg = DistillConfig(init="checkpoint", init_checkpoint=str(path))
    again = init_draft(cfg, small, token_ids=token_ids)
    for name, value in reduced.state_dict().items():
        assert torch.equal(value, again.state_dict()[name]), name
    # another vocabulary (a changed target): shared ids keep the checkpoint's rows, new ids get the target's
    remapped = init_draft(cfg, small, token_ids=torch.tensor([0, 2, 8, 9]))
    head = small.get_output_embeddings().weight
    assert remapped.lm_head.weight.shape == (4, head.shape[1])
    for row, old_row in ((0, 0), (1, 2), (2, 4)):
        assert torch.equal(remapped.lm_head.weight[row], reduced.lm_head.weight[old_row])
    assert torch.equal(remapped.lm_head.weight[3], head[9])
    assert torch.equal(remapped.model.layers[0].self_attn.q_proj.weight,
                       reduced.model.layers[0].self_attn.q_proj.weight)
    with pytest.raises(ValueError, match="init_checkpoint"):
        init_draft(DistillConfig(init="checkpoint"), small)


def test_full_vocab_copy_scatters_the_head_back(target):
    token_ids = torch.tensor([0, 2, 5, 9])
    draft = init_draft(DistillConfig(init_layers=[0]), target, token_ids=token_ids).eval()
    full = full_vocab_copy(draft, token_ids)
    logits, reduced = full(IDS).logits, draft(IDS).logits
    torch.testing.assert_close(logits[..., token_ids], reduced)
    outside = torch.ones(64, dtype=torch.bool)
    outside[token_ids] = False
    assert torch.equal(logits[..., outside], torch.zeros_like(logits[..., outside]))


def test_a_checkpoint_start_must_share_the_targets_tokenizer(tmp_path, target):
    tokenizer = make_tokenizer()
    other = make_tokenizer(extra_words=3)  # the same words, then more: ids past the shared ones differ
    path = save_checkpoint(make_tiny_model(len(other), seed=4), other, tmp_path / "foreign")
    cfg = DistillConfig(init="checkpoint", init_checkpoint=str(path))
    with pytest.raises(TokenizerMismatch):
        init_draft(cfg, make_tiny_model(len(tokenizer), seed=3), tokenizer=tokenizer)

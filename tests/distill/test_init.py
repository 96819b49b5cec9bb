import pytest
import torch

from decode.models.feature_draft import feature_draft_from_target
from decode.models.layer_draft import draft_from_target_layers, frequent_token_ids, full_vocab_copy
from decode.serving.speculators import save_speculators
from distill.init import draft_from_config, feature_layers, init_draft
from distill.step import FeatureStepLogits, feature_loss_step
from pipeline.config import DistillConfig
from pipeline.sources import TokenizerMismatch, save_checkpoint
from tests.conftest import make_tiny_model, make_tokenizer
from tests.distill.tiny_job import tiny_config

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


# Feature drafts warm-start (distill.init=checkpoint, the monitor's retrain_init: champion): from a speculators
# folder or a registered feature draft, with the head's rows carried over to a new vocabulary as a layer draft's are.


FEATURE_VOCAB = 40


@pytest.fixture(scope="module")
def feature_target():
    return make_tiny_model(FEATURE_VOCAB, seed=3, layers=4)


def trained(target, token_ids=None, seed: int = 7):
    """A feature draft whose weights moved away from the target's (as training moves them)."""
    draft = feature_draft_from_target(target, token_ids)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in draft.named_parameters():
            if not name.startswith("embed_tokens"):
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return draft.eval()


def online_batch() -> dict:
    """Two sequences, responses from index 3 on, no cached teacher: the target scores them online."""
    ids = torch.tensor([[1, 5, 9, 3, 7, 7, 2, 4], [1, 7, 2, 8, 8, 6, 0, 0]])
    mask = (torch.arange(8) < torch.tensor([[8], [6]])).long()
    loss_mask = (torch.arange(8) >= 3) & mask.bool()
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask,
            "labels": torch.where(loss_mask, ids, torch.full_like(ids, -100))}


def first_step_loss(draft, target, cfg: DistillConfig, token_ids) -> float:
    batch = online_batch()
    with torch.no_grad():
        return float(feature_loss_step(FeatureStepLogits(draft, cfg.ttt_steps), batch, cfg, target=target,
                                       layers=draft.feature_layers, num_tokens=int(batch["loss_mask"].sum()),
                                       token_ids=token_ids, device="cpu"))


def test_a_feature_draft_starts_from_a_saved_one_with_its_loss(feature_target, tmp_path):
    target = feature_target
    token_ids = torch.tensor([0, 1, 2, 3, 5, 7, 9, 11, 13])
    champion = trained(target, token_ids)
    folder = save_speculators(champion, tmp_path / "champion", verifier_name_or_path="tiny")
    cfg = DistillConfig(family="features", init="checkpoint", init_checkpoint=str(folder), ttt_steps=2)
    warm = init_draft(cfg, target, token_ids=token_ids)
    assert warm.training and torch.equal(warm.token_ids, token_ids)
    for name, value in champion.state_dict().items():
        assert torch.equal(value, warm.state_dict()[name]), name
    fresh = init_draft(DistillConfig(family="features", ttt_steps=2), target, token_ids=token_ids)
    loss = first_step_loss(warm, target, cfg, token_ids)
    assert loss == pytest.approx(first_step_loss(champion, target, cfg, token_ids), abs=1e-6)
    assert abs(loss - first_step_loss(fresh, target, cfg, token_ids)) > 1e-3


def test_a_feature_draft_from_config_starts_random_with_the_targets_head_rows(feature_target):
    """init=config: speculators' start, the layer and fc drawn at the target's initializer_range, the norms at 1,
    the head the target's rows; the same seed, the same draft."""
    target, token_ids = feature_target, torch.tensor([0, 2, 3, 5, 8])
    cfg = DistillConfig(family="features", init="config")
    torch.manual_seed(0)
    draft = init_draft(cfg, target, token_ids=token_ids)
    torch.manual_seed(0)
    again = init_draft(cfg, target, token_ids=token_ids)
    copied = init_draft(DistillConfig(family="features"), target, token_ids=token_ids)
    assert draft.training and torch.equal(draft.lm_head.weight, target.lm_head.weight[token_ids])
    for name, value in draft.state_dict().items():
        assert torch.equal(value, again.state_dict()[name]), name
    q = draft.layer.self_attn.q_proj.weight
    assert not torch.equal(q, copied.layer.self_attn.q_proj.weight) and not torch.equal(draft.fc.weight,
                                                                                          copied.fc.weight)
    assert float(q.std()) == pytest.approx(target.config.initializer_range, rel=0.2)
    assert torch.equal(draft.norm.weight, torch.ones_like(draft.norm.weight))


def test_a_feature_draft_from_config_takes_the_mlp_width_asked(feature_target):
    target, width = feature_target, 3 * feature_target.config.intermediate_size
    draft = init_draft(DistillConfig(family="features", init="config", draft_intermediate_size=width), target)
    assert draft.layer.mlp.up_proj.weight.shape == (width, target.config.hidden_size)
    assert draft.config.intermediate_size == width


def test_a_new_vocabulary_keeps_the_rows_both_heads_share_and_takes_the_targets_for_the_rest(feature_target, tmp_path):
    target = feature_target
    champion = trained(target, torch.tensor([0, 2, 4, 6, 8]))
    folder = save_speculators(champion, tmp_path / "champion", verifier_name_or_path="tiny")
    cfg = DistillConfig(family="features", init="checkpoint", init_checkpoint=str(folder))
    warm = init_draft(cfg, target, token_ids=torch.tensor([0, 4, 5, 8]))
    head = target.get_output_embeddings().weight
    assert warm.token_ids.tolist() == [0, 4, 5, 8] and warm.lm_head.weight.shape == (4, head.shape[1])
    for row, old_row in ((0, 0), (1, 2), (3, 4)):
        assert torch.equal(warm.lm_head.weight[row], champion.lm_head.weight[old_row])
    assert torch.equal(warm.lm_head.weight[2], head[5])
    full = init_draft(cfg, target, token_ids=None)  # back to the full vocabulary: no map, every target id a row
    assert full.token_ids is None and full.lm_head.out_features == FEATURE_VOCAB
    assert torch.equal(full.lm_head.weight[4], champion.lm_head.weight[2]) and torch.equal(full.lm_head.weight[5],
                                                                                          head[5])


def test_the_job_reads_the_layers_its_checkpoint_reads_and_each_family_refuses_the_other(feature_target, tmp_path):
    from decode.models.feature_draft import FeatureDraft

    target = feature_target
    draft = FeatureDraft(target.config, target.get_input_embeddings(), feature_layers=(0, 1, 3))
    folder = save_speculators(draft, tmp_path / "feature", verifier_name_or_path="tiny")
    cfg = DistillConfig(family="features", init="checkpoint", init_checkpoint=str(folder))
    assert feature_layers(cfg, 4) == (0, 1, 3)
    assert feature_layers(DistillConfig(family="features"), 4) == (1, 2, 3)
    assert init_draft(cfg, target).feature_layers == (0, 1, 3)
    layer_draft = save_checkpoint(make_tiny_model(len(make_tokenizer()), seed=1), make_tokenizer(), tmp_path / "ld")
    with pytest.raises(ValueError, match="is not a feature draft"):
        init_draft(DistillConfig(family="features", init="checkpoint", init_checkpoint=str(layer_draft)), target)
    with pytest.raises(ValueError, match="is a feature draft: it warm-starts distill.family=features"):
        init_draft(DistillConfig(init="checkpoint", init_checkpoint=str(folder)), target)


def test_a_challenger_after_a_drift_starts_from_the_champions_weights(isolated_home, monkeypatch):
    """The monitor's retrain (`monitor.check.retrain.challenger_config`, retrain_init: champion) of a feature-draft
    champion: the challenger's first step scores the champion's weights (its loss is the champion's on that batch,
    not a fresh head's), and it registers as challenger."""
    import distill.loop
    from decode.serving.loading import load_draft, load_model
    from distill.train import run_distill
    from monitor.check.retrain import challenger_config
    from pipeline.tracking import setup_mlflow

    tokenizer = make_tokenizer(extra_words=40)
    save_checkpoint(make_tiny_model(len(tokenizer), seed=0, layers=4), tokenizer, isolated_home / "target")
    cfg = tiny_config(isolated_home, "distill.family=features", "distill.ttt_steps=2", "distill.max_steps=4",
                      "decode.gamma=3")
    champion = run_distill(cfg)
    assert champion.alias == "champion"
    seen = []
    original = distill.loop.feature_loss_step

    def recording(model, batch, settings, **kwargs):
        seen.append((batch, settings, kwargs))
        return original(model, batch, settings, **kwargs)

    monkeypatch.setattr(distill.loop, "feature_loss_step", recording)
    retrain = challenger_config(cfg.model_copy(update={"distill": cfg.distill.model_copy(update={"max_steps": 1})}))
    assert retrain.distill.init == "checkpoint" and retrain.distill.init_checkpoint.endswith("@champion")
    challenger = run_distill(retrain)
    assert challenger.alias == "challenger" and challenger.version == "2"

    setup_mlflow(cfg)
    target = load_model(cfg.target, device="cpu", cpu_linear="torch")
    weights = load_draft(f"models:/{cfg.tracking.registered_model}/1", target, cpu_linear="torch").model
    batch, settings, kwargs = seen[0]

    def loss_of(draft) -> float:
        with torch.no_grad():
            return float(original(FeatureStepLogits(draft, settings.ttt_steps), batch, settings, **kwargs))

    assert challenger.history[0]["loss"] == pytest.approx(loss_of(weights), rel=1e-5)
    fresh = feature_draft_from_target(target.model, champion.token_ids)
    assert abs(challenger.history[0]["loss"] - loss_of(fresh)) > 1e-3

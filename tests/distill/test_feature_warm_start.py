"""Feature drafts warm-start (distill.init=checkpoint, the monitor's retrain_init: champion): from a speculators folder
or a registered feature draft, with the head's rows carried over to a new vocabulary as a layer draft's are."""
from __future__ import annotations

import pytest
import torch

from decode.models.feature_draft import feature_draft_from_target
from decode.serving.speculators import save_speculators
from distill.init import feature_layers, init_draft
from distill.step import FeatureStepLogits, feature_loss_step
from pipeline.config import DistillConfig
from pipeline.sources import save_checkpoint
from tests.conftest import make_tiny_model, make_tokenizer
from tests.distill.tiny_job import tiny_config

VOCAB = 40


@pytest.fixture(scope="module")
def target():
    return make_tiny_model(VOCAB, seed=3, layers=4)


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


def test_a_feature_draft_starts_from_a_saved_one_with_its_loss(target, tmp_path):
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


def test_a_new_vocabulary_keeps_the_rows_both_heads_share_and_takes_the_targets_for_the_rest(target, tmp_path):
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
    assert full.token_ids is None and full.lm_head.out_features == VOCAB
    assert torch.equal(full.lm_head.weight[4], champion.lm_head.weight[2]) and torch.equal(full.lm_head.weight[5],
                                                                                          head[5])


def test_the_job_reads_the_layers_its_checkpoint_reads_and_each_family_refuses_the_other(target, tmp_path):
    from decode.models.feature_draft import FeatureDraft

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

"""Where a draft starts: an existing checkpoint, a subset of the target's layers, or a random model from a config.

An optional reduced vocabulary (`decode.models.layer_draft`): the draft's lm_head keeps only the rows of the N token
ids the target itself emits most often on the training traffic, plus every special token. A feature draft starts from
the target's weights (`decode.models.feature_draft.feature_draft_from_target`) or from a checkpoint in the speculators
format: a draftops feature draft (the champion a challenger warm-starts from) or a head made elsewhere
(`draftops models import`), its vocabulary map carried over as a layer draft's head rows are.
"""
from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM

from decode.models.feature_draft import (
    FEATURES,
    FeatureDraft,
    default_feature_layers,
    feature_draft_from_target,
    random_feature_draft,
)
from decode.models.layer_draft import draft_from_target_layers, reduce_vocabulary
from decode.serving.speculators import load_speculators, saved_feature_layers
from pipeline.config import DistillConfig
from pipeline.sources import check_tokenizer_compat, is_speculators_dir, locate, resolve_model


def draft_from_config(target, overrides: dict):
    """A randomly initialized model with the target's config (vocabulary, tokenizer ids) changed by `overrides`."""
    config = copy.deepcopy(target.config)
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise ValueError(f"init_config: the target's config has no key '{key}'")
        setattr(config, key, value)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[: config.num_hidden_layers] + [config.layer_types[-1]] * max(
            0, config.num_hidden_layers - len(config.layer_types))
    return AutoModelForCausalLM.from_config(config, dtype=target.dtype)


def remap_vocabulary(draft, draft_ids: torch.Tensor, token_ids: torch.Tensor, head_weight: torch.Tensor) -> None:
    """Give a reduced-vocabulary `draft` the head over `token_ids` (in place): rows of ids it already has are kept,
    the others are head_weight[id] (the target's head). A feature draft's `token_ids` follow (None again for the full
    vocabulary)."""
    old_head = draft.get_output_embeddings().weight.detach()
    reduce_vocabulary(draft, token_ids, head_weight)
    if isinstance(draft, FeatureDraft):
        full = len(token_ids) == head_weight.shape[0] and torch.equal(token_ids.cpu(), torch.arange(len(token_ids)))
        draft.token_ids = None if full else token_ids.to(head_weight.device).long()
    position = {int(t): row for row, t in enumerate(draft_ids)}
    kept = [(row, position[int(t)]) for row, t in enumerate(token_ids) if int(t) in position]
    if kept:
        new_rows, old_rows = (torch.tensor(x, device=old_head.device) for x in zip(*kept))
        with torch.no_grad():
            draft.lm_head.weight[new_rows] = old_head[old_rows].to(draft.lm_head.weight.dtype)


def init_draft(cfg: DistillConfig, target, *, token_ids: torch.Tensor | None = None, tokenizer=None):
    """The draft described by `cfg` (init, init_layers, init_checkpoint, init_config), in train mode, its own weights
    in float32 (`float32_weights`).

    With `token_ids`, the head is cut to those rows, taken from the target's head; a checkpoint with a reduced head
    over other ids keeps its rows for the ids both share (`remap_vocabulary`). `tokenizer`: the target's; a checkpoint
    to start from must map text to the same ids (`check_tokenizer_compat`), or its weights mean other tokens.
    family "features": a `decode.models.feature_draft.FeatureDraft` from the target's weights, with init=config from
    random weights but the target's head rows (`random_feature_draft`, speculators' start), or with init=checkpoint
    from a speculators folder (`feature_draft_from_checkpoint`); init_layers and init_config do not apply to it.
    """
    if cfg.family == FEATURES:
        if cfg.init == "checkpoint":
            draft = feature_draft_from_checkpoint(cfg, target, token_ids)
        elif cfg.init == "config":
            draft = random_feature_draft(target, token_ids, norm_before_residual=cfg.norm_before_residual,
                                         intermediate_size=cfg.draft_intermediate_size)
        else:
            draft = feature_draft_from_target(target, token_ids, norm_before_residual=cfg.norm_before_residual)
        return float32_weights(draft, target).train()
    if cfg.init == "target_layers":
        draft = draft_from_target_layers(target, cfg.init_layers)
    elif cfg.init == "config":
        draft = draft_from_config(target, cfg.init_config)
    else:
        if is_speculators_dir(checkpoint_folder(cfg)):
            raise ValueError(f"distill.init_checkpoint {cfg.init_checkpoint} is a feature draft: it warm-starts "
                             "distill.family=features")
        loaded = resolve_model(cfg.init_checkpoint, device=target.device, dtype=target.dtype)
        if tokenizer is not None:
            check_tokenizer_compat(tokenizer, loaded.tokenizer)
        draft = loaded.model
        if loaded.token_ids is not None:
            if token_ids is None or not torch.equal(loaded.token_ids, token_ids.cpu()):
                # a warm start for a changed target: its frequent tokens changed, the ids both heads share keep
                # the checkpoint's trained rows, new ids start from the target's head
                new_ids = token_ids if token_ids is not None else torch.arange(target.config.vocab_size)
                remap_vocabulary(draft, loaded.token_ids, new_ids, target.get_output_embeddings().weight.detach())
            return float32_weights(draft, target).train()
    draft = draft.to(target.device)
    if token_ids is not None:
        # The target's head rows (identical to its embeddings when tied) are the best start for the kept ids.
        reduce_vocabulary(draft, token_ids, target.get_output_embeddings().weight.detach())
    return float32_weights(draft, target).train()


def checkpoint_folder(cfg: DistillConfig):
    """The local folder of `cfg.init_checkpoint` (a `models:/` version is downloaded once); ValueError without one."""
    if not cfg.init_checkpoint:
        raise ValueError("distill.init=checkpoint needs distill.init_checkpoint (a model source)")
    return locate(cfg.init_checkpoint).path


def feature_draft_from_checkpoint(cfg: DistillConfig, target, token_ids: torch.Tensor | None) -> FeatureDraft:
    """The feature draft saved at `cfg.init_checkpoint` (a speculators Eagle3 folder, checked against the target by
    `decode.serving.speculators.load_speculators`), with its head remapped to `token_ids` as `init_draft` does for a
    layer draft: ids both heads hold keep the checkpoint's rows, the others start from the target's head."""
    path = checkpoint_folder(cfg)
    if not is_speculators_dir(path):
        raise ValueError(f"distill.init_checkpoint {cfg.init_checkpoint} is not a feature draft (a speculators "
                         "folder): distill.family=features starts from one, or from the target (init=target_layers)")
    draft = load_speculators(path, target)
    saved = draft.token_ids if draft.token_ids is not None else torch.arange(target.config.vocab_size)
    wanted = token_ids if token_ids is not None else torch.arange(target.config.vocab_size)
    if not torch.equal(saved.cpu(), wanted.cpu()):
        remap_vocabulary(draft, saved, wanted, target.get_output_embeddings().weight.detach())
    return draft


def feature_layers(cfg: DistillConfig, num_layers: int) -> tuple[int, ...]:
    """The target layers a feature draft job reads (and caches features of): its init checkpoint's, else the
    default three (`decode.models.feature_draft.default_feature_layers`)."""
    if cfg.init == "checkpoint":
        return saved_feature_layers(checkpoint_folder(cfg))
    return default_feature_layers(num_layers)


def float32_weights(draft, target):
    """`draft` with its own weights in float32 whatever the target's precision: the master copy training updates
    and export saves (accelerate's mixed precision casts the compute). Weights it shares with the target (a feature
    draft's embeddings) stay as the target holds them: casting those would change the target's own forward."""
    shared = {id(p) for p in target.parameters()}
    for parameter in draft.parameters():
        if id(parameter) not in shared and parameter.dtype != torch.float32:
            parameter.data = parameter.data.float()
    return draft

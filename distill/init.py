"""Where a draft starts: an existing checkpoint, a subset of the target's layers, or a random model from a config.

An optional reduced vocabulary (`decode.models.layer_draft`): the draft's lm_head keeps only the rows of the N token
ids the target itself emits most often on the training traffic, plus every special token.
"""
from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM

from decode.models.feature_draft import feature_draft_from_target
from decode.models.layer_draft import draft_from_target_layers, reduce_vocabulary
from pipeline.config import DistillConfig
from pipeline.sources import check_tokenizer_compat, resolve_model


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
    the others are head_weight[id] (the target's head)."""
    old_head = draft.get_output_embeddings().weight.detach()
    reduce_vocabulary(draft, token_ids, head_weight)
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
    family "features": a `decode.models.feature_draft.FeatureDraft` from the target's weights (the init keys do not
    apply).
    """
    if cfg.family == "features":
        return float32_weights(feature_draft_from_target(target, token_ids), target).train()
    if cfg.init == "target_layers":
        draft = draft_from_target_layers(target, cfg.init_layers)
    elif cfg.init == "config":
        draft = draft_from_config(target, cfg.init_config)
    else:
        if not cfg.init_checkpoint:
            raise ValueError("distill.init=checkpoint needs distill.init_checkpoint (a model source)")
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


def float32_weights(draft, target):
    """`draft` with its own weights in float32 whatever the target's precision: the master copy training updates
    and export saves (accelerate's mixed precision casts the compute). Weights it shares with the target (a feature
    draft's embeddings) stay as the target holds them: casting those would change the target's own forward."""
    shared = {id(p) for p in target.parameters()}
    for parameter in draft.parameters():
        if id(parameter) not in shared and parameter.dtype != torch.float32:
            parameter.data = parameter.data.float()
    return draft

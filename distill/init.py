"""Where a draft starts: an existing checkpoint, a subset of the target's layers, or a random model from a config.

An optional reduced vocabulary (FR-Spec / EAGLE-3 "d2t"): the draft's lm_head keeps only the rows of the N token ids
the target itself emits most often on the training traffic, plus every special token. Embeddings stay full-size
(the draft reads target ids); the head rows start as the target's head rows and are untied from the embeddings.
"""
from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterable

import torch
from transformers import AutoModelForCausalLM

from pipeline.config import DistillConfig


def frequent_token_ids(responses: Iterable[Iterable[int]], size: int, special_ids: Iterable[int]) -> torch.Tensor:
    """Sorted ids of the `size` most frequent tokens in `responses` (ties: lower id first) ∪ the special ids."""
    counts = Counter(int(t) for response in responses for t in response)
    ranked = sorted(counts, key=lambda token: (-counts[token], token))
    return torch.tensor(sorted(set(ranked[:size]) | {int(i) for i in special_ids}), dtype=torch.long)


def draft_from_target_layers(target, layers: list[int]):
    """A draft made of the target's embeddings, the chosen decoder layers (in order), final norm and head."""
    n_layers = target.config.num_hidden_layers
    if not layers or any(not 0 <= i < n_layers for i in layers):
        raise ValueError(f"init_layers {layers} must be non-empty indices into the target's {n_layers} layers")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [target.config.layer_types[i] for i in layers]
    draft = AutoModelForCausalLM.from_config(config, dtype=target.dtype)
    source_layers = target.model.layers
    with torch.no_grad():
        draft.model.embed_tokens.load_state_dict(target.model.embed_tokens.state_dict())
        draft.model.norm.load_state_dict(target.model.norm.state_dict())
        for new_index, old_index in enumerate(layers):
            draft.model.layers[new_index].load_state_dict(source_layers[old_index].state_dict())
        if not config.tie_word_embeddings:
            draft.lm_head.load_state_dict(target.lm_head.state_dict())
    return draft


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


def reduce_vocabulary(draft, token_ids: torch.Tensor, head_weight: torch.Tensor) -> None:
    """Give `draft` an untied lm_head whose row i is head_weight[token_ids[i]] (in place)."""
    hidden = draft.config.hidden_size
    head = torch.nn.Linear(hidden, len(token_ids), bias=False, dtype=head_weight.dtype, device=head_weight.device)
    with torch.no_grad():
        head.weight.copy_(head_weight[token_ids.to(head_weight.device)])
    draft.config.tie_word_embeddings = False
    draft.lm_head = head


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


def init_draft(cfg: DistillConfig, target, *, token_ids: torch.Tensor | None = None):
    """The draft described by `cfg` (init, init_layers, init_checkpoint, init_config), in train mode.

    With `token_ids`, the head is cut to those rows, taken from the target's head; a checkpoint with a reduced head
    over other ids keeps its rows for the ids both share (`remap_vocabulary`).
    """
    if cfg.init == "target_layers":
        draft = draft_from_target_layers(target, cfg.init_layers)
    elif cfg.init == "config":
        draft = draft_from_config(target, cfg.init_config)
    else:
        from pipeline.sources import resolve_model

        if not cfg.init_checkpoint:
            raise ValueError("distill.init=checkpoint needs distill.init_checkpoint (a model source)")
        loaded = resolve_model(cfg.init_checkpoint, device=target.device, dtype=target.dtype)
        draft = loaded.model
        if loaded.token_ids is not None:
            if token_ids is None or not torch.equal(loaded.token_ids, token_ids.cpu()):
                # a warm start for a changed target: its frequent tokens changed, the ids both heads share keep
                # the checkpoint's trained rows, new ids start from the target's head
                new_ids = token_ids if token_ids is not None else torch.arange(target.config.vocab_size)
                remap_vocabulary(draft, loaded.token_ids, new_ids, target.get_output_embeddings().weight.detach())
            return draft.train()
    draft = draft.to(target.device)
    if token_ids is not None:
        # The target's head rows (identical to its embeddings when tied) are the best start for the kept ids.
        reduce_vocabulary(draft, token_ids, target.get_output_embeddings().weight.detach())
    return draft.train()


def full_vocab_copy(draft, token_ids: torch.Tensor):
    """An HF-loadable full-vocabulary copy of a reduced-vocabulary draft (for transformers' `assistant_model`).

    The kept rows are scattered back to their target ids; every other row is zero, so those tokens get logit 0 —
    far below the kept tokens' logits in practice, and harmless anyway, since the target verifies every proposal.
    """
    config = copy.deepcopy(draft.config)
    config.tie_word_embeddings = False
    full = AutoModelForCausalLM.from_config(config, dtype=draft.dtype).to(draft.device)
    state = {k: v for k, v in draft.state_dict().items() if not k.startswith("lm_head.")}
    full.load_state_dict(state, strict=False)
    with torch.no_grad():
        full.lm_head.weight.zero_()
        full.lm_head.weight[token_ids.to(draft.device)] = draft.lm_head.weight
    return full.eval()

"""Draft models built from a target: a subset of its layers, a head cut to a reduced vocabulary (FR-Spec / EAGLE-3
"d2t"), and the full-vocabulary copy transformers' assisted generation needs.

A reduced-vocabulary draft keeps full-size embeddings (it reads target ids); its lm_head keeps only the rows of the
chosen target ids, starting as the target's head rows and untied from the embeddings.
"""
from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterable

import torch
from transformers import AutoModelForCausalLM


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


def reduce_vocabulary(draft, token_ids: torch.Tensor, head_weight: torch.Tensor) -> None:
    """Give `draft` an untied lm_head whose row i is head_weight[token_ids[i]] (in place)."""
    hidden = draft.config.hidden_size
    head = torch.nn.Linear(hidden, len(token_ids), bias=False, dtype=head_weight.dtype, device=head_weight.device)
    with torch.no_grad():
        head.weight.copy_(head_weight[token_ids.to(head_weight.device)])
    draft.config.tie_word_embeddings = False
    draft.lm_head = head


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

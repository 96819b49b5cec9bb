"""The attention masks of a token tree fed through the transformers forward, per layer type, sliding windows included.

draftops' transformers caches keep every position of every layer (`decode.runtime.forward.ModelRunner.new_cache`: a
DynamicCache of full layers), so that a round can be rolled back and a tree's path compacted on a sliding-window
layer as on any other. A sliding-window layer then sees only its window through its mask, as transformers builds it:
a query at position p sees the key at position q when 0 <= p - q < window (`masking_utils.sliding_window_overlay`).
Plain passes (`forward_logits`) get those masks from the model's own mask functions, which read the cache's length;
a tree pass hands the model a 4D mask, which transformers uses as given, so this module builds it per layer type.
"""
from __future__ import annotations

import torch

FULL = "full_attention"
SLIDING = "sliding_attention"


def layer_windows(config) -> dict[str, int | None]:
    """The window of each attention layer type `config`'s model has (None: full attention).

    Families that list `layer_types` (Gemma 2/3, Qwen2/3) take a mask per type; the others apply `sliding_window`,
    where set, to every layer (Mistral, Phi-3), and those without one attend to everything (Llama)."""
    config = config.get_text_config(decoder=True)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not types:
        return {SLIDING: window} if window is not None else {FULL: None}
    unknown = set(types) - {FULL, SLIDING}
    if unknown:
        raise ValueError(f"{config.model_type}: attention layers of type {sorted(unknown)} are not supported "
                         "(full and sliding-window attention are)")
    return {kind: window if kind == SLIDING else None for kind in dict.fromkeys(types)}


def tree_attention_mask(config, past: int, positions: torch.Tensor, tree_mask: torch.Tensor,
                        dtype: torch.dtype) -> torch.Tensor | dict[str, torch.Tensor]:
    """The additive mask [1, 1, T, past + T] of T tokens appended to a cache of `past` positions: row i sees the cache
    before its last m slots and those of the last m its row of tree_mask [T, m] allows; a sliding-window layer only
    those within its window of positions[i]. One tensor where every layer has the same window, else a mask per
    layer type (the form Gemma's and Qwen's forwards take).

    The cache before the last m slots holds the committed text, slot j at position j. Among the last m (a tree's
    nodes, parents before children), those a row sees are its ancestors, one per depth: the k-th from its own slot
    lies k positions before it."""
    n, m = tree_mask.shape
    end = past + n
    visible = torch.ones(n, end, dtype=torch.bool, device=tree_mask.device)
    visible[:, end - m :] = tree_mask
    windows = layer_windows(config)
    if any(w is not None for w in windows.values()):
        distance = positions[:, None] - torch.arange(end, device=tree_mask.device)[None, :]
        seen = tree_mask.long()
        distance[:, end - m :] = seen.flip(-1).cumsum(-1).flip(-1) - seen  # seen slots after each one
    minimum = torch.finfo(dtype).min

    def additive(allowed: torch.Tensor) -> torch.Tensor:
        return torch.zeros(n, end, dtype=dtype, device=tree_mask.device).masked_fill_(~allowed, minimum)[None, None]

    masks = {kind: additive(visible if w is None else visible & (distance < w)) for kind, w in windows.items()}
    if len(set(windows.values())) == 1:
        return next(iter(masks.values()))
    return masks

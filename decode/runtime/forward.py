"""How draftops runs a causal LM: the lean forward where the architecture allows, the transformers forward with a
DynamicCache otherwise (also the reference), explicit positions into the KV cache, and the CPU kernels of its linear
layers (`decode.runtime.kernels`). Both forwards also take token trees (a tree mask, per-node positions) and both
caches are compacted to a tree round's accepted path (`compact`), so tree rounds run on either."""
from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence

import torch
from transformers import DynamicCache

from decode.runtime.lean import KVCache, LeanDecoder, compiled_lean, lean_problem, notice_fallback, use_compiled_passes
from decode.runtime.masks import tree_attention_mask


def target_features(hidden_states: tuple[torch.Tensor, ...], layers: tuple[int, ...]) -> torch.Tensor:
    """The draft's input from transformers' `output_hidden_states` (entry i is the state entering layer i)."""
    return torch.cat([hidden_states[i] for i in layers], dim=-1)


@functools.cache
def _cache_keyword(model_class: type) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters or "past_key_values" not in parameters else "past_key_values"


def with_cache(model, cache: DynamicCache) -> dict:
    """The keyword argument that hands `model`'s transformers forward its KV cache: `cache` since transformers renamed
    `past_key_values` (5.25 has `cache`, 5.17 `past_key_values`). A forward takes an unknown keyword silently and
    then attends to no cache at all, so the name is read off the forward's own signature."""
    return {_cache_keyword(type(model)): cache}


def forward_logits(model, tokens: torch.Tensor, cache: DynamicCache, start: int, keep_last: bool) -> torch.Tensor:
    """Feed tokens [T] at positions start..start+T-1 through the cache -> logits [T, V] (or [1, V] if keep_last)."""
    positions = torch.arange(start, start + tokens.shape[0], device=tokens.device)
    out = model(
        input_ids=tokens[None],
        position_ids=positions[None],
        use_cache=True,
        logits_to_keep=1 if keep_last else 0,
        **with_cache(model, cache),
    )
    return out.logits[0]


def forward_features(model, tokens: torch.Tensor, cache: DynamicCache, start: int,
                     layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode.runtime.lean.LeanDecoder.forward_features` through the transformers forward (`output_hidden_states`)."""
    positions = torch.arange(start, start + tokens.shape[0], device=tokens.device)
    out = model(input_ids=tokens[None], position_ids=positions[None], use_cache=True, output_hidden_states=True,
                **with_cache(model, cache))
    return out.logits[0], target_features(out.hidden_states, layers)[0]


def forward_tree(model, tokens: torch.Tensor, cache: DynamicCache, positions: torch.Tensor,
                 tree_mask: torch.Tensor, layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`decode.runtime.lean.LeanDecoder.forward_tree_features` through the transformers forward: appended to the cache,
    with a 4D mask per layer type (`decode.runtime.masks`; transformers uses a 4D mask as given) -> (logits [T, V],
    features of `layers` or None without)."""
    dtype = model.get_input_embeddings().weight.dtype
    mask = tree_attention_mask(model.config, full_layers(cache).get_seq_length(), positions, tree_mask, dtype)
    out = model(input_ids=tokens[None], position_ids=positions[None], attention_mask=mask,
                use_cache=True, output_hidden_states=bool(layers), **with_cache(model, cache))
    return out.logits[0], target_features(out.hidden_states, layers)[0] if layers else None


def full_layers(cache: DynamicCache) -> DynamicCache:
    """`cache`, checked to hold every position of every layer, as `ModelRunner.new_cache` makes it: a sliding-window
    layer of transformers' own (a DynamicCache built from the config) drops the positions past its window, so a round
    can neither be rolled back nor its tree path compacted there."""
    if any(getattr(layer, "is_sliding", False) for layer in cache.layers):
        raise ValueError("draftops' tree rounds need a cache of full layers (ModelRunner.new_cache): this one has "
                         "sliding-window layers, which drop the positions a rollback or a tree's path needs")
    return cache


def rollback(cache: DynamicCache, length: int) -> None:
    """Crop the cache to its first `length` positions."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def compact(cache, start: int, slots: list[int]) -> None:
    """Keep the first `start` positions of the cache, then the entries at `slots` (ascending, each >= start) moved
    to start, start+1, ...; the rest is dropped. A tree round keeps the accepted path this way: the nodes' keys were
    computed at their depth's position, so once moved they are what feeding the path plainly gives."""
    if isinstance(cache, KVCache):
        cache.compact(start, slots)
        return
    index = torch.tensor(slots, dtype=torch.long)
    for layer in full_layers(cache).layers:
        layer.keys = torch.cat([layer.keys[:, :, :start], layer.keys[:, :, index.to(layer.keys.device)]], 2)
        layer.values = torch.cat([layer.values[:, :, :start], layer.values[:, :, index.to(layer.values.device)]], 2)


class ModelRunner:
    """A causal LM as draftops runs it: `decode.runtime.lean.LeanDecoder` where the architecture allows (the same
    function with far less per-call overhead), else the transformers forward with a DynamicCache, which is also the
    reference (a one-line notice says so, once per model: `decode.runtime.lean.notice_fallback`)."""

    def __init__(self, model, lean: bool = True, compiled: bool | None = None):
        """compiled: True, the lean forward's passes through `torch.compile` (`decode.runtime.lean.use_compiled_passes`,
        after which every runner of `model` left at None is compiled too); False, the eager lean forward; None, as
        `model` is set (`decode.compiled`). It needs the lean forward."""
        if compiled:
            if not lean:
                raise ValueError("a compiled forward compiles the lean forward: it needs lean=True")
            use_compiled_passes(model)
        self.model = model
        shared = compiled_lean(model) if lean and compiled is not False else None
        self.lean = shared or (LeanDecoder(model) if lean and lean_problem(model) is None else None)
        if lean and self.lean is None:
            notice_fallback(model)

    def new_cache(self):
        """A KV cache for this runner's forward. The transformers forward's keeps every position of every layer (a
        DynamicCache of full layers, not the config's sliding-window ones): rounds roll back and compact it on any
        layer, and a sliding-window layer's masks show it its window alone (`decode.runtime.masks`)."""
        return self.lean.new_cache() if self.lean is not None else DynamicCache()

    def forward(self, tokens: torch.Tensor, cache, start: int, keep_last: bool) -> torch.Tensor:
        if self.lean is not None:
            return self.lean.forward_logits(tokens, cache, start, keep_last)
        return forward_logits(self.model, tokens, cache, start, keep_last)

    def forward_features(self, tokens: torch.Tensor, cache, start: int,
                         layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` of every token, with the hidden states entering `layers` concatenated -> (logits [T, V],
        features [T, len(layers) * H]) for a feature draft."""
        if self.lean is not None:
            return self.lean.forward_features(tokens, cache, start, layers)
        return forward_features(self.model, tokens, cache, start, layers)

    def forward_tree(self, tokens: torch.Tensor, cache, start: int, positions: torch.Tensor,
                     tree_mask: torch.Tensor) -> torch.Tensor:
        """Tokens [T] of a token tree into the cache from position `start` on (cropped there first), at `positions`,
        each seeing the cache before the last m slots and those of them its row of tree_mask [T, m] allows
        (`decode.runtime.lean.LeanDecoder.forward_tree`) -> logits [T, V]."""
        return self.forward_tree_features(tokens, cache, start, positions, tree_mask, ())[0]

    def forward_tree_features(self, tokens: torch.Tensor, cache, start: int, positions: torch.Tensor,
                              tree_mask: torch.Tensor, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward_tree`, with the hidden states entering `layers` at every node -> (logits [T, V], features
        [T, len(layers) * H], None without layers) for a feature draft."""
        rollback(cache, start)
        if self.lean is not None:
            return self.lean.forward_tree_features(tokens, cache, start, positions, tree_mask, layers)
        return forward_tree(self.model, tokens, cache, positions, tree_mask, layers)


@torch.inference_mode()
def greedy_decode(runner: ModelRunner, prompt: list[int], max_new_tokens: int,
                  eos_token_ids: Sequence[int] = ()) -> list[int]:
    """Plain greedy decoding, one target step per token through `runner` (the decoder's own forward)."""
    device = next(runner.model.parameters()).device
    cache = runner.new_cache()
    logits = runner.forward(torch.tensor(prompt, device=device), cache, 0, True)[-1]
    out: list[int] = []
    for i in range(max_new_tokens):
        token = logits.argmax()
        out.append(int(token))
        if out[-1] in eos_token_ids or i + 1 == max_new_tokens:
            break
        logits = runner.forward(token[None], cache, len(prompt) + i, True)[-1]
    return out

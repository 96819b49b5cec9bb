"""The decoder layers of a model as the lean forward (`decode.runtime.lean`) runs them, read off each family's layers
as its row of `pipeline.families.FAMILIES` says they differ from Llama's.

`lean_layers` turns a model's decoder layers into `LeanLayer`s, the one place the lean forward (eager and compiled)
takes weights from: q/k/v and gate/up products stacked (`ConcatLinear`) or fused as stored (`FusedLinear`, Phi-3),
the per-head q/k norms, Gemma's norms after attention and around the MLP, the attention soft-cap of the config (Gemma
2) and the rotation of the layer's type (Gemma 3). Gemma's scaled embeddings and (1 + w) norms are its own modules',
which the lean forward calls. A sliding window is applied in the lean attention's mask (`window_masks`; the KV cache
keeps every position): a query at position p sees keys at positions p - window + 1 .. p, as transformers'
sliding-window mask has it.
"""
from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from decode.runtime.kernels import ConcatLinear
from pipeline.families import FAMILIES, Family


class FusedLinear:
    """A linear layer whose output is several projections side by side (Phi-3's qkv_proj, gate_up_proj), with
    `ConcatLinear`'s interface: the outputs as a tuple, and `current()` the layer holding them all."""

    def __init__(self, layer: torch.nn.Linear, sizes: list[int]):
        if sum(sizes) != layer.out_features:
            raise ValueError(f"fused projections of {sizes} rows in a layer of {layer.out_features}")
        self.layer, self.sizes = layer, sizes

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.layer(x).split(self.sizes, -1)

    def current(self) -> torch.nn.Linear:
        return self.layer


class LeanLayer(torch.nn.Module):
    """One decoder layer as the lean forward runs it: its norms, its q|k|v and gate|up products (stacked or fused),
    its output and down projections, the optional per-head q/k norms, its activation, sliding window, attention
    soft-cap and rotation (a key of `rotations`). A module over the model's own (shared) modules, so that a compiled
    pass (`decode.runtime.compiled_pass`) registers them.

    x + attention(input_norm(x)) [attention_out_norm after o_proj], then x + mlp(mlp_norm(x)) [mlp_out_norm after
    down_proj]: Llama's mlp_norm is its post_attention_layernorm; Gemma's are pre_feedforward_layernorm, and the two out
    norms its post_attention_ and post_feedforward_layernorm."""

    def __init__(self, *, input_norm: torch.nn.Module, mlp_norm: torch.nn.Module, qkv: ConcatLinear | FusedLinear,
                 o_proj: torch.nn.Linear, gate_up: ConcatLinear | FusedLinear, down_proj: torch.nn.Linear,
                 act: Callable[[torch.Tensor], torch.Tensor], scaling: float, window: int | None = None,
                 q_norm: torch.nn.Module | None = None, k_norm: torch.nn.Module | None = None,
                 attention_out_norm: torch.nn.Module | None = None, mlp_out_norm: torch.nn.Module | None = None,
                 softcap: float | None = None, rotation: str | None = None):
        super().__init__()
        self.input_norm, self.mlp_norm, self.o_proj, self.down_proj, self.act = (
            input_norm, mlp_norm, o_proj, down_proj, act)
        self.q_norm, self.k_norm = q_norm, k_norm
        self.attention_out_norm, self.mlp_out_norm = attention_out_norm, mlp_out_norm
        self.qkv, self.gate_up = qkv, gate_up  # not modules: their weights are the projections' own, or stacked
        self.scaling, self.window, self.softcap, self.rotation = scaling, window, softcap, rotation

    def heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: tuple[int, int, int, int],
              rotate: Callable, rotation: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Projections [B, T, *] -> q, k, v [B, heads, T, head_dim], q and k normed (if the family does) and rotated
        by `rotate(q, k, cos, sin)` (`rotary_function`) at this layer's (cos, sin) (`rotations`). shape: (B, T,
        heads, kv_heads)."""
        b, n, heads, kv_heads = shape
        q, k, v = q.view(b, n, heads, -1), k.view(b, n, kv_heads, -1), v.view(b, n, kv_heads, -1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q.transpose(1, 2), k.transpose(1, 2), *rotation)
        return q, k, v.transpose(1, 2)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        """Attention of q [B, heads, T, d] over keys, values [B, kv_heads, S, d] under `mask` (True: seen) -> [B, T,
        heads * d]. With a soft-cap (Gemma 2): scores -> cap * tanh(scores / cap) before the mask, as its eager
        attention; SDPA has no soft-cap."""
        if self.softcap is None:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling, enable_gqa=True)
        else:
            groups = q.shape[1] // keys.shape[1]
            keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
            scores = torch.tanh(q @ keys.transpose(2, 3) * (self.scaling / self.softcap)) * self.softcap
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            out = scores.softmax(-1) @ values
        b, _, n, _ = q.shape
        return out.transpose(1, 2).reshape(b, n, -1)

    def add_attention(self, x: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """The residual stream after the attention: x + o_proj's output (normed, for Gemma)."""
        return x + (attention if self.attention_out_norm is None else self.attention_out_norm(attention))

    def add_mlp(self, x: torch.Tensor, mlp: torch.Tensor) -> torch.Tensor:
        """The residual stream after the MLP: x + down_proj's output (normed, for Gemma)."""
        return x + (mlp if self.mlp_out_norm is None else self.mlp_out_norm(mlp))


def _window(config, family: Family, index: int) -> int | None:
    window = getattr(config, "sliding_window", None)
    if family.window == "every":
        return window
    if family.window == "layer_types" and (getattr(config, "layer_types", None) or [None] * (index + 1))[index] \
            == "sliding_attention":
        return window
    return None


def lean_layers(model) -> list[LeanLayer]:
    """`model`'s decoder layers as `LeanLayer`s (a family of `pipeline.families.FAMILIES`), in order."""
    config = model.config
    family = FAMILIES[config.model_type]
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    out = []
    for index, layer in enumerate(model.model.layers):
        attention, mlp = layer.self_attn, layer.mlp
        head_dim = attention.head_dim
        if family.fused_qkv:
            qkv = FusedLinear(attention.qkv_proj, [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
        else:
            qkv = ConcatLinear([attention.q_proj, attention.k_proj, attention.v_proj])
        if family.fused_gate_up:
            gate_up = FusedLinear(mlp.gate_up_proj, [mlp.gate_up_proj.out_features // 2] * 2)
        else:
            gate_up = ConcatLinear([mlp.gate_proj, mlp.up_proj])
        sandwich = family.sandwich_norms
        out.append(LeanLayer(
            input_norm=layer.input_layernorm, qkv=qkv, o_proj=attention.o_proj, gate_up=gate_up,
            mlp_norm=layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm,
            down_proj=mlp.down_proj, act=getattr(mlp, family.activation), scaling=attention.scaling,
            window=_window(config, family, index),
            q_norm=attention.q_norm if family.qk_norm else None, k_norm=attention.k_norm if family.qk_norm else None,
            attention_out_norm=layer.post_attention_layernorm if sandwich else None,
            mlp_out_norm=layer.post_feedforward_layernorm if sandwich else None,
            softcap=getattr(config, "attn_logit_softcapping", None),
            rotation=config.layer_types[index] if family.rotary_by_layer_type else None))
    return out


def rotary_function(model) -> Callable:
    """The family's own `apply_rotary_pos_emb(q, k, cos, sin)` (Phi-3's rotates a leading part of each head only,
    where its config says so)."""
    return sys.modules[type(model.model.layers[0].self_attn).__module__].apply_rotary_pos_emb


def rotations(model, layers: list[LeanLayer], x: torch.Tensor,
              positions: torch.Tensor) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
    """(cos, sin) of `positions` ([B, T]) for each `LeanLayer.rotation` of `layers`: one for every layer, or one per
    layer type (Gemma 3's sliding and global layers rotate by different bases)."""
    rotary = model.model.rotary_emb
    return {kind: rotary(x, positions) if kind is None else rotary(x, positions, kind)
            for kind in sorted({layer.rotation for layer in layers}, key=str)}


def soft_capped(logits: torch.Tensor, config) -> torch.Tensor:
    """The logits as the family's head gives them: cap * tanh(logits / cap) where it caps them (Gemma 2)."""
    cap = getattr(config, "final_logit_softcapping", None)
    return logits if cap is None else torch.tanh(logits / cap) * cap


def window_masks(layers: list[LeanLayer], mask: torch.Tensor | None, positions: torch.Tensor, start: int,
                 end: int) -> dict[int | None, torch.Tensor | None]:
    """Per window of `layers` (None: no window), the attention mask of a pass: `mask` (None: a single token seeing
    every slot; [T, end], or [B, 1, T, end] for positions [B, T] of a ragged pass) with, for a window w, each query at
    position p limited to keys at positions > p - w. A slot's position: a ragged pass's slots are positions; otherwise
    the slots before `start` are positions 0..start-1 and slots start..end-1 hold the tokens fed, at `positions`
    (a tree's nodes sit at their depth)."""
    masks: dict[int | None, torch.Tensor | None] = {None: mask}
    for window in {layer.window for layer in layers} - {None}:
        if positions.dim() == 2:
            near = torch.arange(end, device=positions.device) > positions[:, None, :, None] - window
        else:
            keys = torch.cat([torch.arange(start, device=positions.device), positions])
            near = keys[None, :] > positions[:, None] - window
        masks[window] = near if mask is None else mask & near
    return masks

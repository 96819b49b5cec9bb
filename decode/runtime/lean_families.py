"""The model families the lean forward (`decode.runtime.lean`) runs, and what it reads off each one's decoder layers.

Each family here has Llama's block (pre-norm attention with rotary positions and grouped KV heads, then a gated
MLP) up to small differences, given per `model_type` by a `FamilySpec`: q/k/v biases (Qwen2/2.5: the stacked
projection carries them), RMS norms on each query and key head before the rotation (Qwen3, Gemma 3), a sliding window
(Mistral, Phi-3 on every layer; Qwen2/3, Gemma 2/3 on the layers `config.layer_types` marks), projections stored fused
(Phi-3's `qkv_proj` and `gate_up_proj`), and Gemma's norms after attention and around the MLP, its attention and
final logit soft-capping and (Gemma 3) a rotation per layer type. Gemma's scaled embeddings and (1 + w) norms are its
own modules', which the lean forward calls. `lean_layers` turns a model's decoder layers into `LeanLayer`s, the one
place the lean forward (eager and compiled) takes weights from. A sliding window is applied in the lean attention's
mask (the KV cache keeps every position): a query at position p sees keys at positions p - window + 1 .. p, as
transformers' sliding-window mask has it. Other architectures (GPT-NeoX, ...) run on the transformers forward;
`notice_fallback` says so once per model.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from decode.runtime.kernels import ConcatLinear

FALLBACK_ATTRIBUTE = "_draftops_fallback_noticed"  # set on a model once its fallback notice is out


@dataclass(frozen=True)
class FamilySpec:
    """How a family's decoder layer differs from Llama's. window: where its sliding window applies ("every" layer,
    or the "layer_types" ones marked "sliding_attention"; None: no window)."""

    fused_qkv: bool = False  # one qkv_proj (rows: q, then k, then v) instead of q_proj, k_proj, v_proj
    fused_gate_up: bool = False  # one gate_up_proj (rows: gate, then up) instead of gate_proj, up_proj
    qk_norm: bool = False  # q_norm and k_norm over each head's dimensions, before the rotation
    window: str | None = None
    activation: str = "act_fn"  # the MLP's attribute holding its activation
    # Gemma's: post_attention_layernorm on the attention's output, pre_ and post_feedforward_layernorm around the MLP
    sandwich_norms: bool = False
    rotary_by_layer_type: bool = False  # rotary_emb(x, positions, layer_type): a rotation per layer type (Gemma 3)


FAMILIES = {
    "llama": FamilySpec(),
    "qwen2": FamilySpec(window="layer_types"),  # q/k/v biases: the stacked q|k|v projection carries them
    "qwen3": FamilySpec(qk_norm=True, window="layer_types"),
    "mistral": FamilySpec(window="every"),
    "phi3": FamilySpec(fused_qkv=True, fused_gate_up=True, window="every", activation="activation_fn"),
    "gemma2": FamilySpec(window="layer_types", sandwich_norms=True),  # soft-capping: its config's
    "gemma3_text": FamilySpec(qk_norm=True, window="layer_types", sandwich_norms=True, rotary_by_layer_type=True),
}
FAMILY_NAMES = "Llama, Qwen2/2.5, Qwen3, Mistral, Phi-3 or Gemma 2/3"  # for the errors of what needs the lean forward


def supports(model) -> bool:
    """Whether the lean forward computes `model`'s function: a family of `FAMILIES` in eval mode, with eager or SDPA
    attention and no tensor-parallel slicing of its projections (`pretraining_tp`)."""
    config = model.config
    return (config.model_type in FAMILIES and not model.training and not getattr(config, "pretraining_tp", 1) > 1
            and getattr(config, "_attn_implementation", "sdpa") in ("sdpa", "eager"))


def notice_fallback(model, compiled: bool = False) -> None:
    """One line on stderr, once per model, that `model` runs on the transformers forward (where `supports` says no):
    the same tokens, with transformers' per-call cost; `compiled`: and that `decode.compiled` was asked for but does
    not apply (the compiled passes are the lean forward's)."""
    if model.__dict__.get(FALLBACK_ATTRIBUTE):
        return
    model.__dict__[FALLBACK_ATTRIBUTE] = True
    extra = "; decode.compiled does not apply to it" if compiled else ""
    print(f"draftops: notice: this {model.config.model_type} model runs on the transformers forward, not the lean one "
          f"(the same tokens, more time per call{extra}): the lean forward runs {FAMILY_NAMES} models in eval mode, "
          "attention eager or sdpa", file=sys.stderr, flush=True)


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


def _window(config, spec: FamilySpec, index: int) -> int | None:
    window = getattr(config, "sliding_window", None)
    if spec.window == "every":
        return window
    if spec.window == "layer_types" and (getattr(config, "layer_types", None) or [None] * (index + 1))[index] \
            == "sliding_attention":
        return window
    return None


def lean_layers(model) -> list[LeanLayer]:
    """`model`'s decoder layers as `LeanLayer`s (a family of `FAMILIES`), in order."""
    config = model.config
    spec = FAMILIES[config.model_type]
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    out = []
    for index, layer in enumerate(model.model.layers):
        attention, mlp = layer.self_attn, layer.mlp
        head_dim = attention.head_dim
        if spec.fused_qkv:
            qkv = FusedLinear(attention.qkv_proj, [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
        else:
            qkv = ConcatLinear([attention.q_proj, attention.k_proj, attention.v_proj])
        if spec.fused_gate_up:
            gate_up = FusedLinear(mlp.gate_up_proj, [mlp.gate_up_proj.out_features // 2] * 2)
        else:
            gate_up = ConcatLinear([mlp.gate_proj, mlp.up_proj])
        sandwich = spec.sandwich_norms
        out.append(LeanLayer(
            input_norm=layer.input_layernorm, qkv=qkv, o_proj=attention.o_proj, gate_up=gate_up,
            mlp_norm=layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm,
            down_proj=mlp.down_proj, act=getattr(mlp, spec.activation), scaling=attention.scaling,
            window=_window(config, spec, index),
            q_norm=attention.q_norm if spec.qk_norm else None, k_norm=attention.k_norm if spec.qk_norm else None,
            attention_out_norm=layer.post_attention_layernorm if sandwich else None,
            mlp_out_norm=layer.post_feedforward_layernorm if sandwich else None,
            softcap=getattr(config, "attn_logit_softcapping", None),
            rotation=config.layer_types[index] if spec.rotary_by_layer_type else None))
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

"""The model families the lean forward (`decode.runtime.lean`) runs, and what it reads off each one's decoder layers.

Each family here has Llama's block (pre-norm attention with rotary positions and grouped KV heads, then a gated
MLP) up to small differences, given per `model_type` by a `FamilySpec`: q/k/v biases (Qwen2/2.5: the stacked
projection carries them), RMS norms on each query and key head before the rotation (Qwen3), a sliding window (Mistral,
Phi-3 on every layer; Qwen2/3 on the layers `config.layer_types` marks), and projections stored fused (Phi-3's
`qkv_proj` and `gate_up_proj`). `lean_layers` turns a model's decoder layers into `LeanLayer`s, the one place the
lean forward (eager and compiled) takes weights from. A sliding window is applied in the lean attention's mask (the
KV cache keeps every position): a query at position p sees keys at positions p - window + 1 .. p, as transformers'
sliding-window mask has it. Other families (Gemma's scaled embeddings and soft-capping, GPT-NeoX's blocks, ...) run
on the transformers forward; `notice_fallback` says so once per model.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

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


FAMILIES = {
    "llama": FamilySpec(),
    "qwen2": FamilySpec(window="layer_types"),  # q/k/v biases: the stacked q|k|v projection carries them
    "qwen3": FamilySpec(qk_norm=True, window="layer_types"),
    "mistral": FamilySpec(window="every"),
    "phi3": FamilySpec(fused_qkv=True, fused_gate_up=True, window="every", activation="activation_fn"),
}
FAMILY_NAMES = "Llama, Qwen2/2.5, Qwen3, Mistral or Phi-3"  # for the errors of what needs the lean forward


def supports(model) -> bool:
    """Whether the lean forward computes `model`'s function: a family of `FAMILIES` in eval mode, with eager or SDPA
    attention and no tensor-parallel slicing of its projections (`pretraining_tp`)."""
    config = model.config
    return (config.model_type in FAMILIES and not model.training and not getattr(config, "pretraining_tp", 1) > 1
            and getattr(config, "_attn_implementation", "sdpa") in ("sdpa", "eager"))


def notice_fallback(model) -> None:
    """One line on stderr, once per model, that `model` runs on the transformers forward (where `supports` says no):
    the same tokens, with transformers' per-call cost."""
    if model.__dict__.get(FALLBACK_ATTRIBUTE):
        return
    model.__dict__[FALLBACK_ATTRIBUTE] = True
    print(f"draftops: notice: this {model.config.model_type} model runs on the transformers forward (the same tokens, "
          f"more time per call): the lean forward runs {FAMILY_NAMES} models in eval mode, attention eager or sdpa",
          file=sys.stderr, flush=True)


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
    its output and down projections, the optional per-head q/k norms, its activation and sliding window. A module
    over the model's own (shared) modules, so that a compiled pass (`decode.runtime.compiled_pass`) registers them."""

    def __init__(self, *, input_norm: torch.nn.Module, post_norm: torch.nn.Module, qkv: ConcatLinear | FusedLinear,
                 o_proj: torch.nn.Linear, gate_up: ConcatLinear | FusedLinear, down_proj: torch.nn.Linear,
                 act: Callable[[torch.Tensor], torch.Tensor], scaling: float, window: int | None = None,
                 q_norm: torch.nn.Module | None = None, k_norm: torch.nn.Module | None = None):
        super().__init__()
        self.input_norm, self.post_norm, self.o_proj, self.down_proj, self.act = (
            input_norm, post_norm, o_proj, down_proj, act)
        self.q_norm, self.k_norm = q_norm, k_norm
        self.qkv, self.gate_up = qkv, gate_up  # not modules: their weights are the projections' own, or stacked
        self.scaling, self.window = scaling, window

    def heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: tuple[int, int, int, int],
              rotate: Callable) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projections [B, T, *] -> q, k, v [B, heads, T, head_dim], q and k normed (if the family does) and rotated
        by `rotate(q, k)`. shape: (B, T, heads, kv_heads)."""
        b, n, heads, kv_heads = shape
        q, k, v = q.view(b, n, heads, -1), k.view(b, n, kv_heads, -1), v.view(b, n, kv_heads, -1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q.transpose(1, 2), k.transpose(1, 2))
        return q, k, v.transpose(1, 2)


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
        out.append(LeanLayer(
            input_norm=layer.input_layernorm, post_norm=layer.post_attention_layernorm, qkv=qkv,
            o_proj=attention.o_proj, gate_up=gate_up, down_proj=mlp.down_proj, act=getattr(mlp, spec.activation),
            scaling=attention.scaling, window=_window(config, spec, index),
            q_norm=attention.q_norm if spec.qk_norm else None, k_norm=attention.k_norm if spec.qk_norm else None))
    return out


def rotary_function(model) -> Callable:
    """The family's own `apply_rotary_pos_emb(q, k, cos, sin)` (Phi-3's rotates a leading part of each head only,
    where its config says so)."""
    return sys.modules[type(model.model.layers[0].self_attn).__module__].apply_rotary_pos_emb


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

"""What drafts need to know about a target's model family: the Llama layer a feature draft builds for it, a target
layer's weights under Llama's names, and the logits a family's forward computes from its last hidden state.

A feature draft (EAGLE-3) is one Llama decoder layer whatever the target, as `speculators` builds it
(`speculators/train/cli.py` `create_transformer_layer_config`) and vLLM serves it (`llama_eagle3`): the target's
shapes (hidden size, heads, key/value heads, head size, MLP width), activation, norm epsilon, rotary settings and
context length, without the family's extras (q/k/v biases, q/k norms, sandwich norms, soft-capping, sliding windows).
`draft_layer_config` derives that config; `llama_layer_weights` reads a target layer of any supported family as the
Llama layer's weights, as the family's row of `pipeline.families.FAMILIES` describes its layers (Phi-3's fused
projections split, Gemma's `1 + weight` norms turned into plain gains), so a draft can start from the target's own
layer.

`head_logits` is the family's own step from last hidden state to logits: the head, then Gemma 2's
`final_logit_softcapping` (and Granite's and Cohere's logit scales). Training scores the draft's logits computed so
(`distill.step.ResponseLogits`), which decoding gets from the model's forward.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import LlamaConfig

from pipeline.families import FAMILIES


def text_config(config):
    """The decoder's config of a (possibly multimodal) model config."""
    return config.get_text_config(decoder=True)


def draft_rope_parameters(config) -> dict:
    """The target's rotary settings for a Llama layer: one flat set (of a family with one set per layer type, the
    sliding layers', as speculators picks), with every dimension rotated (a partial rotary factor dropped, as
    speculators does: its Llama layer rotates whole heads)."""
    parameters = copy.deepcopy(getattr(config, "rope_parameters", None) or {})
    if "rope_theta" not in parameters:  # {"full_attention": {...}, "sliding_attention": {...}}
        nested = parameters.get("sliding_attention") or parameters.get("full_attention") or {}
        parameters = dict(nested)
    parameters.setdefault("rope_type", "default")
    parameters.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    parameters.pop("partial_rotary_factor", None)
    parameters.pop("type", None)
    return parameters


def draft_layer_config(target_config) -> LlamaConfig:
    """The one-layer Llama config of a feature draft over a target of any family (see the module docstring). A Llama
    target's own biases are kept; other families' are not (the draft layer is Llama's, as vLLM serves it)."""
    text = text_config(target_config)
    llama = text.model_type == "llama"
    heads = text.num_attention_heads
    return LlamaConfig(
        vocab_size=text.vocab_size, hidden_size=text.hidden_size, intermediate_size=text.intermediate_size,
        num_hidden_layers=1, num_attention_heads=heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        hidden_act=getattr(text, "hidden_act", None) or getattr(text, "hidden_activation", None) or "silu",
        max_position_embeddings=text.max_position_embeddings,
        rms_norm_eps=getattr(text, "rms_norm_eps", None) or getattr(text, "layer_norm_eps", None) or 1e-6,
        rope_parameters=draft_rope_parameters(text), tie_word_embeddings=False,
        attention_bias=bool(getattr(text, "attention_bias", False)) if llama else False,
        mlp_bias=bool(getattr(text, "mlp_bias", False)) if llama else False,
        initializer_range=getattr(text, "initializer_range", 0.02),
        bos_token_id=text.bos_token_id, eos_token_id=text.eos_token_id, pad_token_id=text.pad_token_id,
        architectures=["LlamaForCausalLM"])


def norm_gain(norm: torch.nn.Module, model_type: str) -> torch.Tensor:
    """An RMSNorm's per-channel gain as Llama's RMSNorm holds it: Gemma's norms multiply by (1 + weight)
    (`pipeline.families.Family.offset_norms`)."""
    weight = norm.weight.detach()
    return 1.0 + weight if FAMILIES[model_type].offset_norms else weight


PROJECTIONS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
               "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}  # a Llama layer's linears


@dataclass
class LlamaLayerWeights:
    """One target decoder layer as a Llama layer's parts: `weights` and `biases` (only those the family has) by part
    (`PROJECTIONS`' keys), `input_norm` and `mlp_norm` (the norm before the MLP: Gemma's `pre_feedforward_layernorm`)
    as plain gains."""

    weights: dict[str, torch.Tensor]
    biases: dict[str, torch.Tensor]
    input_norm: torch.Tensor
    mlp_norm: torch.Tensor


def _split(linear, rows: list[int], names: tuple[str, ...], weights: dict, biases: dict) -> None:
    for name, weight in zip(names, linear.weight.detach().split(rows), strict=True):
        weights[name] = weight
    if linear.bias is not None:
        biases.update(zip(names, linear.bias.detach().split(rows), strict=True))


def llama_layer_weights(layer: torch.nn.Module, config) -> LlamaLayerWeights:
    """`layer` (a decoder layer of `config`'s family) as a Llama layer's weights: Phi-3's fused `qkv_proj` ([q; k; v]
    rows) and `gate_up_proj` ([gate; up] rows) split, Gemma's norms as plain gains. Family extras a Llama layer lacks
    (Qwen3's and Gemma 3's q/k norms, Gemma's post-attention and post-MLP norms) are left out."""
    text = text_config(config)
    family = FAMILIES[text.model_type]
    weights, biases = {}, {}
    attention, mlp = layer.self_attn, layer.mlp
    if family.fused_qkv:
        kv_rows = (getattr(text, "num_key_value_heads", None) or text.num_attention_heads) * attention.head_dim
        _split(attention.qkv_proj, [text.num_attention_heads * attention.head_dim, kv_rows, kv_rows], ("q", "k", "v"),
               weights, biases)
    if family.fused_gate_up:
        _split(mlp.gate_up_proj, [mlp.gate_up_proj.out_features // 2] * 2, ("gate", "up"), weights, biases)
    for name, path in PROJECTIONS.items():
        if name not in weights:
            linear = layer.get_submodule(path)
            _split(linear, [linear.out_features], (name,), weights, biases)
    before_mlp = layer.pre_feedforward_layernorm if family.sandwich_norms else layer.post_attention_layernorm
    return LlamaLayerWeights(weights, biases, norm_gain(layer.input_layernorm, text.model_type),
                             norm_gain(before_mlp, text.model_type))


def head_logits(model, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """`model`'s logits from its last hidden states [..., H] (after the final norm), as its own forward computes
    them: the output head (only its `rows`, if given), then the family's final scaling (Gemma 2's
    `final_logit_softcapping`: c·tanh(x/c); Granite's `logits_scaling`: x/s; Cohere's `logit_scale`: x·s)."""
    head = model.get_output_embeddings()
    if rows is None:
        logits = head(hidden)
    else:
        bias = None if head.bias is None else head.bias[rows]
        logits = torch.nn.functional.linear(hidden, head.weight[rows], bias)
    config = text_config(model.config)
    if (cap := getattr(config, "final_logit_softcapping", None)) is not None:
        logits = torch.tanh(logits / cap) * cap
    if (scale := getattr(config, "logits_scaling", None)) is not None:
        logits = logits / scale
    if (scale := getattr(config, "logit_scale", None)) is not None:
        logits = logits * scale
    return logits

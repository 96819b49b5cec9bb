"""The model families draftops distills and decodes, one `Family` row each in `FAMILIES`: what the source loader
accepts, what the lean forward runs, what the draft builders read off a target's layers, and what docs/families.md
lists (a test holds the page to this table).

Each family has Llama's block (pre-norm attention with rotary positions and grouped KV heads, then a gated MLP) up to
the differences its row names: projections stored fused (Phi-3's `qkv_proj` and `gate_up_proj`), RMS norms on each
query and key head before the rotation (Qwen3, Gemma 3), a sliding window (Mistral, Phi-3 on every layer; Qwen2/3,
Gemma 2/3 on the layers `config.layer_types` marks), and Gemma's norms after attention and around the MLP, its (1 + w)
norms and (Gemma 3) a rotation per layer type. What a family's config carries itself (Qwen2's q/k/v biases, Gemma 2's
soft-capping, Gemma's embedding scale) needs no field.

A target of another architecture would load, then fail minutes later (a layer draft is cut from `model.model.layers`,
a feature draft reads the decoder layers' hidden states, the tree masks know full and sliding-window attention):
`architecture_problem` reads the checkpoint's config.json before any weights are loaded or any text generated.
Checkpoints whose config asks for custom code (`auto_map`) load through transformers' own class when their
`model_type` is one of these families; otherwise they are refused, since draftops never sets `trust_remote_code`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """One model family: its config's `model_type`, its `name` in messages and docs (`checkpoints`: which
    checkpoints it covers, where the name alone does not say), and how its decoder layer differs from Llama's.
    window: where its sliding window applies ("every" layer, or the "layer_types" ones `config.layer_types` marks
    "sliding_attention"; None: no window)."""

    model_type: str
    name: str
    checkpoints: str = ""
    fused_qkv: bool = False  # one qkv_proj (rows: q, then k, then v) instead of q_proj, k_proj, v_proj
    fused_gate_up: bool = False  # one gate_up_proj (rows: gate, then up) instead of gate_proj, up_proj
    qk_norm: bool = False  # q_norm and k_norm over each head's dimensions, before the rotation
    window: str | None = None
    activation: str = "act_fn"  # the MLP's attribute holding its activation
    # Gemma's: post_attention_layernorm on the attention's output, pre_ and post_feedforward_layernorm around the MLP
    sandwich_norms: bool = False
    offset_norms: bool = False  # RMSNorms that multiply by (1 + weight) (transformers' GemmaRMSNorm and its copies)
    rotary_by_layer_type: bool = False  # rotary_emb(x, positions, layer_type): a rotation per layer type (Gemma 3)


FAMILIES = {family.model_type: family for family in (
    Family("llama", "Llama", checkpoints="Llama 2/3, SmolLM2"),
    Family("qwen2", "Qwen2/2.5", window="layer_types"),
    Family("qwen3", "Qwen3", qk_norm=True, window="layer_types"),
    Family("mistral", "Mistral", window="every"),
    Family("gemma2", "Gemma 2", window="layer_types", sandwich_norms=True, offset_norms=True),
    Family("gemma3_text", "Gemma 3", checkpoints="text-only", qk_norm=True, window="layer_types",
           sandwich_norms=True, offset_norms=True, rotary_by_layer_type=True),
    Family("phi3", "Phi-3", fused_qkv=True, fused_gate_up=True, window="every", activation="activation_fn"),
)}

_NAMES = [family.name for family in FAMILIES.values()]
FAMILY_NAMES = f"{', '.join(_NAMES[:-1])} or {_NAMES[-1]}"  # "Llama, Qwen2/2.5, ... or Phi-3", for messages


def supported_families() -> str:
    """Every family with its `model_type` (and the checkpoints it covers), for the refusal of any other."""
    return ", ".join(f"{family.name} ({family.model_type}{': ' + family.checkpoints if family.checkpoints else ''})"
                     for family in FAMILIES.values())


def architecture_problem(config: dict) -> str | None:
    """Why draftops cannot distill or decode the checkpoint of `config` (its config.json), in one line; None if it
    can."""
    model_type = config.get("model_type")
    if model_type in FAMILIES:
        return None
    architecture = (config.get("architectures") or [model_type])[0]
    if config.get("auto_map"):
        return (f"its config asks for custom code (auto_map, model_type {model_type!r}): draftops does not set "
                "trust_remote_code, which would run Python shipped with the checkpoint, and loads only the "
                f"architectures transformers ships for the families it supports: {supported_families()}")
    return (f"architecture {architecture} (model_type {model_type!r}) is not supported: draftops distills and "
            f"decodes {supported_families()}")

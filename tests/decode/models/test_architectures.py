"""Drafts over every family (decode.models.architectures): the feature draft's Llama layer takes the target's shapes
and settings, and a feature draft started from the target computes, part by part, what the target's last layer
computes (Phi-3's fused projections split, Gemma's 1 + weight norms turned into gains)."""
from __future__ import annotations

import pytest
import torch
from transformers import Gemma3TextConfig, Phi3Config

from decode.models.architectures import draft_layer_config, draft_rope_parameters, llama_layer_weights
from decode.models.feature_draft import feature_draft_from_target
from tests.families import FAMILIES, tiny_family


def test_the_draft_layer_config_takes_the_targets_shapes_and_settings():
    gemma = Gemma3TextConfig(hidden_size=2560, intermediate_size=10240, num_attention_heads=8, num_key_value_heads=4,
                             head_dim=256, rms_norm_eps=1e-6, vocab_size=262208, max_position_embeddings=131072)
    config = draft_layer_config(gemma)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (
        "llama", 1, 2560, 10240)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (8, 4, 256)
    assert (config.hidden_act, config.rms_norm_eps, config.max_position_embeddings) == ("gelu_pytorch_tanh", 1e-6,
                                                                                        131072)
    assert config.attention_bias is False and config.tie_word_embeddings is False
    # one rotary set for the one layer: of Gemma 3's per-layer-type sets the sliding layers', as speculators picks
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    phi = Phi3Config(hidden_size=3072, num_attention_heads=24, partial_rotary_factor=0.75)
    assert "partial_rotary_factor" not in draft_rope_parameters(phi) and draft_layer_config(phi).head_dim == 128
    assert draft_layer_config(tiny_family("qwen2").config).attention_bias is False  # Llama's layer, as vLLM serves it


@torch.no_grad()
@pytest.mark.parametrize("family", FAMILIES)
def test_a_feature_draft_from_the_target_computes_its_last_layers_parts(family):
    target = tiny_family(family)
    draft = feature_draft_from_target(target)
    last, layer = target.model.layers[-1], draft.layer
    x = torch.randn(3, 64, dtype=torch.float64)
    mlp_norm = getattr(last, "pre_feedforward_layernorm", None) or last.post_attention_layernorm
    torch.testing.assert_close(layer.mlp(x), last.mlp(x))
    torch.testing.assert_close(layer.hidden_norm(x), last.input_layernorm(x), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(layer.post_attention_layernorm(x), mlp_norm(x), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(draft.norm(x), target.model.norm(x), atol=1e-6, rtol=1e-6)
    with_features = torch.cat([torch.zeros_like(x), x], dim=-1)  # the features half of q/k/v: the last layer's
    weights = llama_layer_weights(last, target.config)
    for name in ("q", "k", "v"):
        projection = getattr(layer.self_attn, f"{name}_proj")
        bias = weights.biases.get(name)  # a Llama layer has none, unless the target is a Llama with biases
        expected = x @ weights.weights[name].T + (0 if bias is None or projection.bias is None else bias)
        torch.testing.assert_close(projection(with_features), expected)
    if hasattr(last.self_attn, "qkv_proj"):
        fused = last.self_attn.qkv_proj(x)
        torch.testing.assert_close(torch.cat([x @ weights.weights[n].T for n in ("q", "k", "v")], -1), fused)
    torch.testing.assert_close(draft.lm_head.weight, target.get_output_embeddings().weight)

"""Tiny random-weight targets of every model family draftops supports, built from transformers' own configs.

No downloads: each family's config class with small shapes, in float64 like `tests.decode.tiny`. `window`: the
sliding-window size for the families that have one (Mistral, Gemma 2/3, Phi-3), None for their default-free variant.
The same builders serve the lossless, lean-forward, draft and export tests of every family
(`tests/pipeline/test_families.py` checks they cover `pipeline.families.FAMILIES`); `save_family` saves one as a
checkpoint for the command-line tests.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from pipeline.sources import save_checkpoint
from tests.conftest import make_tokenizer

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _config(family: str, vocab_size: int, context: int, window: int | None, init_range: float, layers: int):
    common = dict(SHAPE, vocab_size=vocab_size, max_position_embeddings=context, initializer_range=init_range,
                  num_hidden_layers=layers)
    if family == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False)
    if family == "llama3":  # llama3 rope scaling, tied head as in Llama-3.2
        return LlamaConfig(**common, tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if family == "qwen2":  # q/k/v biases, tied embeddings
        return Qwen2Config(**common, tie_word_embeddings=True)
    if family == "qwen3":  # q/k norms
        return Qwen3Config(**common, head_dim=16, tie_word_embeddings=False)
    if family == "mistral":  # sliding window over every layer
        return MistralConfig(**common, sliding_window=window, tie_word_embeddings=False)
    if family == "gemma2":  # embedding scale, attention and final soft-capping, sliding and global layers, tied head
        return Gemma2Config(**common, head_dim=16, sliding_window=window or 4096, query_pre_attn_scalar=16,
                            attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    if family == "gemma3":  # q/k norms, sliding and global layers with their own rope, tied head
        return Gemma3TextConfig(**common, head_dim=16, sliding_window=window or 4096, query_pre_attn_scalar=16,
                                sliding_window_pattern=2)
    if family == "phi3":  # fused qkv and gate_up projections
        return Phi3Config(**common, sliding_window=window, tie_word_embeddings=False)
    if family == "gpt_neox":  # not supported: the refusal tests use it
        return GPTNeoXConfig(**{k: v for k, v in common.items() if k not in ("num_key_value_heads",)})
    raise ValueError(family)


FAMILIES = ("llama", "llama3", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3")
WINDOWED = ("mistral", "gemma2", "gemma3", "phi3")


def tiny_family(family: str, seed: int = 0, *, vocab_size: int = 128, context: int = 512, window: int | None = None,
                init_range: float = 0.3, dtype: torch.dtype = torch.float64, layers: int = 4) -> torch.nn.Module:
    """A tiny random model of `family` (FAMILIES, or "gpt_neox") of `layers` decoder layers (Gemma's alternate
    sliding and global), eager attention, in `dtype`."""
    torch.manual_seed(seed)
    config = _config(family, vocab_size, context, window, init_range, layers)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config)
    if family in ("gemma2", "gemma3"):
        _gemma_context_matters(model)
    return model.to(dtype).eval()


@torch.no_grad()
def _gemma_context_matters(model) -> None:
    """Gemma scales its embeddings by sqrt(hidden) and ties its head to them: at random init the token's own embedding
    swamps the residual stream, and the greedy next token repeats the last one whatever the context (so a wrong
    window or mask would go unseen). Embeddings scaled back by sqrt(hidden), the final norm's gain raised so that the
    tied head's logits keep the other families' spread: the next token depends on the context."""
    model.model.embed_tokens.weight.mul_(model.config.hidden_size ** -0.5)
    model.model.norm.weight.add_(7.0)


@torch.no_grad()
def perturbed(model: torch.nn.Module, seed: int, noise: float) -> torch.nn.Module:
    """A draft close to `model`, of its family: the same weights plus relative Gaussian noise."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    for param in draft.parameters():
        param.add_(noise * param.std() * torch.randn(param.shape, generator=generator, dtype=param.dtype))
    return draft


TEXT = ("write python code to sort a list of numbers one two three four five six seven eight nine ten and explain "
        "the function please")  # 40 tokens with the chat template: longer than a window of 16


def save_family(root: Path, family: str, window: int | None = None, *, draft: bool = True) -> tuple[str, str | None]:
    """A float32 `family` target (and a perturbed copy as its draft) saved with the tests' word-level tokenizer."""
    tokenizer = make_tokenizer()
    target = tiny_family(family, window=window, vocab_size=len(tokenizer), dtype=torch.float32)
    target_dir = save_checkpoint(target, tokenizer, root / f"{family}-{window}")
    draft_dir = save_checkpoint(perturbed(target, 1, 0.05), tokenizer, root / f"{family}-{window}-draft") if draft \
        else None
    return str(target_dir), None if draft_dir is None else str(draft_dir)

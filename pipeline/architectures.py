"""The model families draftops distills and decodes, and the early refusal of any other checkpoint.

A target of another architecture would load, then fail minutes later (a layer draft is cut from `model.model.layers`,
a feature draft reads the decoder layers' hidden states, the tree masks know full and sliding-window attention):
`architecture_problem` reads the checkpoint's config.json before any weights are loaded or any text generated.
Checkpoints whose config asks for custom code (`auto_map`) load through transformers' own class when their
`model_type` is one of these families; otherwise they are refused, since draftops never sets `trust_remote_code`.
"""
from __future__ import annotations

# model_type -> the family's name, as docs/families.md lists them
FAMILIES = {
    "llama": "Llama (Llama 2/3, SmolLM2)",
    "qwen2": "Qwen2/2.5",
    "qwen3": "Qwen3",
    "mistral": "Mistral",
    "gemma2": "Gemma 2",
    "gemma3_text": "Gemma 3 (text-only checkpoints)",
    "phi3": "Phi-3",
}


def supported_families() -> str:
    return ", ".join(f"{name} ({model_type})" for model_type, name in FAMILIES.items())


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

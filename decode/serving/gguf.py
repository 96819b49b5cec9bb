"""A layer draft as llama.cpp's GGUF (`--model-draft`), its vocabulary taken from the target's own GGUF.

llama.cpp's speculative decoding refuses a draft whose vocabulary differs from the target's (common/speculative.cpp
compares vocab type, size, BOS/EOS and every token's text), so the draft's `tokenizer.*` metadata is copied verbatim
from the target's GGUF instead of being rebuilt from a tokenizer. The weights are the draft's full-vocabulary
checkpoint (`decode.serving.export`: a reduced head's dropped rows are zero), named as llama.cpp names a Llama, with
the query and key projections permuted from Hugging Face's rotary layout (the two halves of each head rotate
together) to GGUF's (adjacent pairs rotate together), as llama.cpp's own `convert_hf_to_gguf.py` does
(`LlamaModel.permute`). Norms stay float32 (llama.cpp's kernels take them so); matrices are float16, float32 or Q8_0
(blocks of 32 weights sharing one float16 scale, quantized by the gguf package as llama.cpp's `llama-quantize` does;
a matrix whose rows are not a multiple of 32 stays float16).

The architecture keys are written from the checkpoint's config, with the rotary base read where transformers 5 keeps
it (`rope_parameters`) as well as where older configs had it (`rope_theta`): a GGUF without the right
`llama.rope.freq_base` still loads and runs, and only its acceptance shows the positions are wrong.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

GGUF_DTYPES = {"f16": (np.float16, gguf.LlamaFileType.MOSTLY_F16), "f32": (np.float32, gguf.LlamaFileType.ALL_F32),
               "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0)}

GLOBAL_TENSORS = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                  "lm_head.weight": "output.weight"}
LAYER_TENSORS = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
                 "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
                 "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
                 "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
                 "mlp.down_proj.weight": "ffn_down.weight"}
VOCABULARY_PREFIX = "tokenizer."


class GGUFExportError(ValueError):
    """A checkpoint llama.cpp cannot take as a Llama, or a vocabulary GGUF that does not fit it."""


def rope_permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a query or key projection with `heads` heads, from Hugging Face's rotary layout (dimension i of a head
    rotates with i + d/2) to GGUF's (2i rotates with 2i + 1): llama.cpp's `LlamaModel.permute`."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def rope_base(config) -> float:
    """The rotary base of a Llama config; GGUFExportError for any rotary scaling llama.cpp would need keys for."""
    parameters = getattr(config, "rope_parameters", None) or {}
    kind = parameters.get("rope_type", "default")
    if kind != "default" or getattr(config, "rope_scaling", None) not in (None, {}, parameters):
        raise GGUFExportError(f"rotary scaling {kind!r} is not exported to GGUF (only plain rotary positions)")
    base = parameters.get("rope_theta", getattr(config, "rope_theta", None))
    if base is None:
        raise GGUFExportError("the config has no rotary base (rope_parameters.rope_theta or rope_theta)")
    return float(base)


def vocabulary_fields(vocabulary: Path) -> list[tuple[str, object, list]]:
    """(key, value, types) of every `tokenizer.*` field of the GGUF at `vocabulary`."""
    reader = gguf.GGUFReader(vocabulary)
    return [(key, field.contents(), field.types) for key, field in reader.fields.items()
            if key.startswith(VOCABULARY_PREFIX)]


def _tensors(state: dict[str, torch.Tensor], layers: int, heads: int, kv_heads: int, tied: bool):
    names = dict(GLOBAL_TENSORS)
    for i in range(layers):
        names.update({f"model.layers.{i}.{hf}": f"blk.{i}.{ours}" for hf, ours in LAYER_TENSORS.items()})
    if tied:
        names.pop("lm_head.weight")
    missing = sorted(set(names) - set(state))
    unused = sorted(set(state) - set(names) - {"lm_head.weight"})
    if missing or unused:
        raise GGUFExportError(f"not a plain Llama checkpoint: missing {missing[:4]}, unknown {unused[:4]}")
    for hf, ours in names.items():
        weight = state[hf].detach().to(torch.float32)
        if hf.endswith("q_proj.weight"):
            weight = rope_permute(weight, heads)
        elif hf.endswith("k_proj.weight"):
            weight = rope_permute(weight, kv_heads)
        yield ours, weight


def _add_tensor(writer, name: str, array: np.ndarray, matrix_dtype) -> None:
    """A norm as float32; a matrix as `matrix_dtype`, a numpy dtype or a quantization type (then float16 where its
    rows do not split into the type's blocks)."""
    if array.ndim == 1:
        writer.add_tensor(name, array.astype(np.float32))
    elif isinstance(matrix_dtype, gguf.GGMLQuantizationType):
        block = gguf.GGML_QUANT_SIZES[matrix_dtype][0]
        if array.shape[-1] % block:
            writer.add_tensor(name, array.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, matrix_dtype), raw_dtype=matrix_dtype)
    else:
        writer.add_tensor(name, array.astype(matrix_dtype))


def write_llama_gguf(state: dict[str, torch.Tensor], config, vocabulary: Path, out: Path, *,
                     dtype: str = "f16", name: str = "draftops draft") -> Path:
    """Write the Llama checkpoint (`state`, `config`) to the GGUF file `out` with the `tokenizer.*` metadata of the
    GGUF at `vocabulary`, matrices in `dtype` (GGUF_DTYPES), norms in float32. GGUFExportError for a model that is not
    a plain Llama or a vocabulary of another size."""
    if dtype not in GGUF_DTYPES:
        raise GGUFExportError(f"unknown GGUF dtype {dtype!r}: choose one of {', '.join(GGUF_DTYPES)}")
    if config.model_type != "llama":
        raise GGUFExportError(f"model type {config.model_type!r}: only Llama checkpoints are exported to GGUF (another "
                              "family: export --format hf and convert that with llama.cpp's convert_hf_to_gguf.py, "
                              "as its target's GGUF was)")
    fields = vocabulary_fields(vocabulary)
    tokens = next((value for key, value, _ in fields if key == "tokenizer.ggml.tokens"), None)
    if tokens is None or len(tokens) != config.vocab_size:
        raise GGUFExportError(f"{vocabulary}: {len(tokens or [])} tokens, the draft's vocab_size is "
                              f"{config.vocab_size}")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    matrix_dtype, file_type = GGUF_DTYPES[dtype]
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(name)
    writer.add_file_type(file_type)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(rope_base(config))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    for key, value, types in fields:
        writer.add_key_value(key, value, types[0], types[1] if len(types) > 1 else None)
    tied = bool(config.tie_word_embeddings) or "lm_head.weight" not in state
    for tensor_name, weight in _tensors(state, config.num_hidden_layers, heads, kv_heads, tied):
        _add_tensor(writer, tensor_name, weight.numpy(), matrix_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out

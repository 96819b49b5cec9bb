"""What `draftops models import` checks in a head folder before it allocates anything for it: a folder someone else
made may be broken or hostile, and each way it can be is one line, never a traceback, a 4 TB allocation or a file read
from outside the folder.

In order: every file (and symlink) resolves inside the folder; `model.safetensors` has a sane header, read alone
(its length, the JSON, each tensor's dtype, shape and byte range within the file) without the payload; the layer
config is a mapping whose sizes are whole numbers within bounds derived from the target (hidden size equal to the
target's, intermediate size at most MAX_INTERMEDIATE_MULTIPLE times the target's, heads that divide the hidden size);
the tensors' shapes are those of the draft that config describes, built on the meta device (no memory); `d2t`/`t2d`
map into the target's vocabulary; and every weight is finite, read one tensor at a time."""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import LlamaConfig

from decode.models.feature_draft import FeatureDraft

WEIGHTS_FILE, CONFIG_FILE = "model.safetensors", "config.json"
SHARED = "embed_tokens.weight"
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
MAX_INTERMEDIATE_MULTIPLE = 8  # a draft layer's MLP at most this many times the target's
MAX_CONFIG_BYTES = 1 << 20
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
               "F8_E4M3": 1, "F8_E5M2": 1}


class HeadCheckError(ValueError):
    """A head folder that cannot be imported, in one line."""


def check_inside(folder: Path) -> None:
    """Every entry of `folder` (symlinks included, at any depth) resolves inside it."""
    root = folder.resolve()
    for entry in folder.rglob("*"):
        if entry.is_symlink() and not entry.resolve().is_relative_to(root):
            raise HeadCheckError(f"{entry}: a symlink to {entry.resolve()}, outside the folder; copy the file in")


def safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype, shape)} from the file's header alone, each entry's byte range checked against its dtype,
    its shape and the file's size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise HeadCheckError(f"{path}: not a safetensors file ({size} bytes)")
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise HeadCheckError(f"{path}: not a safetensors file (its header claims {length} bytes, the file has "
                                 f"{size})")
        try:
            header = json.loads(f.read(length))
        except (ValueError, RecursionError):
            raise HeadCheckError(f"{path}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise HeadCheckError(f"{path}: not a safetensors file (its header is not a mapping)")
    payload, out = size - 8 - length, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            ok = (dtype in DTYPE_BYTES and all(isinstance(n, int) and n >= 0 for n in (*shape, start, end))
                  and 0 <= start <= end <= payload and end - start == math.prod(shape) * DTYPE_BYTES[dtype])
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise HeadCheckError(f"{path}: tensor {name!r} has a broken header entry {str(entry)[:200]}")
        out[name] = (dtype, shape)
    return out


def _layer_config(folder: Path, target_config) -> tuple[dict, LlamaConfig]:
    """(the saved config, its layer as a LlamaConfig), each size checked against the target's."""
    path = folder / CONFIG_FILE
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise HeadCheckError(f"{path}: over {MAX_CONFIG_BYTES >> 20} MiB, not a head's config")
    try:
        saved = json.loads(path.read_text())
    except (ValueError, RecursionError, UnicodeDecodeError) as exc:
        raise HeadCheckError(f"{path}: not JSON: {exc}") from None
    layer = saved.get("transformer_layer_config") if isinstance(saved, dict) else None
    if not isinstance(layer, dict):
        raise HeadCheckError(f"{path}: transformer_layer_config is missing or not a mapping")
    hidden = target_config.hidden_size
    inter = getattr(target_config, "intermediate_size", None) or 4 * hidden
    if layer.get("hidden_size") != hidden:
        raise HeadCheckError(f"hidden size mismatch: {path} was made for {str(layer.get('hidden_size'))[:40]}, the "
                             f"target has {hidden}")
    if layer.get("vocab_size") != target_config.vocab_size:
        raise HeadCheckError(f"vocab mismatch: {path} was made for a target of {str(layer.get('vocab_size'))[:40]} "
                             f"tokens, the target has {target_config.vocab_size}")
    bounds = {"intermediate_size": (1, MAX_INTERMEDIATE_MULTIPLE * inter),
              "num_attention_heads": (1, hidden), "num_key_value_heads": (1, hidden),
              "head_dim": (1, hidden), "max_position_embeddings": (1, 1 << 24)}
    for key, (low, high) in bounds.items():
        value = layer.get(key)
        if value is None and key in ("head_dim", "max_position_embeddings", "num_key_value_heads"):
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise HeadCheckError(f"{path}: transformer_layer_config.{key} is {str(value)[:40]}, not a whole number in "
                                 f"[{low}, {high}] (from the target's sizes)")
    heads, kv = layer["num_attention_heads"], layer.get("num_key_value_heads") or layer["num_attention_heads"]
    if layer.get("head_dim") is None and hidden % heads or heads % kv:
        raise HeadCheckError(f"{path}: {heads} attention heads ({kv} key/value heads) do not divide the hidden size "
                             f"{hidden} evenly")
    layers = saved.get("eagle_aux_hidden_state_layer_ids")
    if not isinstance(layers, list) or not layers or not all(
            isinstance(i, int) and 0 <= i < target_config.num_hidden_layers for i in layers):
        raise HeadCheckError(f"{path}: eagle_aux_hidden_state_layer_ids {str(layers)[:80]} are not layers of the "
                             f"target's {target_config.num_hidden_layers}")
    draft_vocab = saved.get("draft_vocab_size")
    if not isinstance(draft_vocab, int) or not 1 <= draft_vocab <= target_config.vocab_size:
        raise HeadCheckError(f"{path}: draft_vocab_size {str(draft_vocab)[:40]} is not within the target's "
                             f"{target_config.vocab_size} ids")
    try:
        return saved, LlamaConfig.from_dict({k: v for k, v in layer.items() if k != "model_type"})
    except (TypeError, ValueError) as exc:
        raise HeadCheckError(f"{path}: transformer_layer_config: {str(exc).splitlines()[0]}") from None


def expected_shapes(saved: dict, layer: LlamaConfig, target_config) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in a head of this config, from a draft built on the meta device (nothing allocated)."""
    layers = tuple(saved["eagle_aux_hidden_state_layer_ids"])
    rows = saved["draft_vocab_size"]
    try:
        with torch.device("meta"):
            embed = torch.nn.Embedding(target_config.vocab_size, target_config.hidden_size)
            token_ids = None if rows == target_config.vocab_size else torch.arange(rows)
            draft = FeatureDraft(layer, embed, feature_layers=layers, token_ids=token_ids)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise HeadCheckError(f"transformer_layer_config does not describe a draft layer: "
                             f"{str(exc).splitlines()[0]}") from None
    shapes = {name: tuple(t.shape) for name, t in draft.state_dict().items() if name != SHARED}
    if rows != target_config.vocab_size:
        shapes |= {"d2t": (rows,), "t2d": (target_config.vocab_size,)}
    return shapes


def check_vocab_maps(path: Path, vocab: int) -> None:
    """d2t names target ids (id = row + d2t[row]) that rise within [0, vocab); t2d marks exactly those."""
    with safe_open(path, framework="pt") as f:
        d2t, t2d = f.get_tensor("d2t").long(), f.get_tensor("t2d")
    ids = torch.arange(len(d2t)) + d2t
    if len(ids) and (ids.min() < 0 or ids.max() >= vocab or not bool((ids[1:] > ids[:-1]).all())):
        raise HeadCheckError(f"{path}: d2t names ids outside the target's vocabulary of {vocab}, or not in rising "
                             f"order (ids {int(ids.min())}..{int(ids.max())})")
    if not torch.equal(t2d.bool().nonzero().flatten(), ids):
        raise HeadCheckError(f"{path}: t2d does not mark the ids d2t names")


def check_head(folder: Path, target_config) -> None:
    """A speculators Eagle3 folder fit for `load_speculators` on this target, checked without allocating its weights
    (module docstring); HeadCheckError in one line otherwise."""
    check_inside(folder)
    weights = folder / WEIGHTS_FILE
    found = safetensors_header(weights)
    found.pop(SHARED, None)
    saved, layer = _layer_config(folder, target_config)
    wanted = expected_shapes(saved, layer, target_config)
    if missing := sorted(set(wanted) - set(found)):
        raise HeadCheckError(f"{weights}: tensors missing: {', '.join(missing[:5])}")
    if extra := sorted(set(found) - set(wanted)):
        raise HeadCheckError(f"{weights}: tensors this head does not have: {', '.join(extra[:5])}")
    for name, shape in wanted.items():
        if found[name][1] != shape:
            raise HeadCheckError(f"{weights}: {name} has shape {list(found[name][1])}, this config and target need "
                                 f"{list(shape)}")
    if "d2t" in wanted:
        check_vocab_maps(weights, target_config.vocab_size)
    with safe_open(weights, framework="pt") as f:
        for name in wanted:
            if found[name][0].startswith(("F", "BF")) and not bool(torch.isfinite(f.get_tensor(name)).all()):
                raise HeadCheckError(f"{weights}: {name} holds NaN or infinite values")

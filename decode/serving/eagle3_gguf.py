"""A feature draft as llama.cpp's EAGLE-3 GGUF (`llama-server -md FILE --spec-type draft-eagle3`), written by
llama.cpp's own converter.

llama.cpp's `convert_hf_to_gguf.py` reads a `speculators` Eagle3 folder as it is (its `LlamaModel` takes the
`Eagle3Speculator` architecture: `transformer_layer_config` merged into the hyperparameters, `layers.0.*` renamed,
`hidden_norm` as `attn_norm_2`, `fc` and `d2t` kept, `t2d` dropped) and takes the target's tokenizer and layer count
from `--target-model-dir`. The GGUF's `eagle3.target_layers` are the folder's three feature layers: llama.cpp's loader
refuses any other count, and it captures each layer's input, as vLLM and draftops do. The converter runs from the
llama.cpp source tree that `draftops llama-cpp build` unpacked (the pinned sdist,
`decode.serving.llamacpp.converter_script`), with this Python (it needs `sentencepiece`), offline.

llama.cpp's EAGLE-3 graph is a Llama layer with SiLU and plain or llama3-scaled rotary positions: a draft of another
activation (a Gemma target's) or rotary scaling, or one whose residual takes the normed features (speculators'
`norm_before_residual`), is refused. The file is read back (`check_eagle3_gguf`): its metadata
and every matrix must be the draft's.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from decode.serving.gguf import GGUFExportError, rope_permute

EAGLE3_ROPE_TYPES = ("default", "llama3")  # the rotary kinds llama.cpp's EAGLE-3 layer computes


def check_convertible(folder: Path) -> dict:
    """The speculators config of `folder` once llama.cpp's EAGLE-3 layer computes what it describes (three feature
    layers, SiLU, plain or llama3 rotary positions); GGUFExportError otherwise."""
    config = json.loads((folder / "config.json").read_text())
    layer = config["transformer_layer_config"]
    layers = config.get("eagle_aux_hidden_state_layer_ids") or []
    if len(layers) != 3:
        raise GGUFExportError(f"llama.cpp's EAGLE-3 reads exactly three target layers; this draft reads {layers}")
    if config.get("norm_before_residual"):
        raise GGUFExportError("this draft adds its attention output to the normed features (norm_before_residual), "
                              "which llama.cpp's EAGLE-3 layer is not known to compute")
    if (act := layer.get("hidden_act", "silu")) != "silu":
        raise GGUFExportError(f"llama.cpp's EAGLE-3 layer uses SiLU; this draft's MLP uses {act!r}")
    rope = (layer.get("rope_parameters") or layer.get("rope_scaling") or {}).get("rope_type", "default")
    if rope not in EAGLE3_ROPE_TYPES:
        raise GGUFExportError(f"rotary scaling {rope!r} is not exported to llama.cpp's EAGLE-3 (only "
                              f"{', '.join(EAGLE3_ROPE_TYPES)})")
    return config


def write_eagle3_gguf(folder: Path, target_dir: Path, out: Path, converter: Path, *, dtype: str = "f16") -> Path:
    """The speculators Eagle3 folder `folder` as the EAGLE-3 GGUF `out` by llama.cpp's `converter`
    (convert_hf_to_gguf.py), for the target whose Hugging Face folder (config and tokenizer) is `target_dir`, matrices
    in `dtype` (f16 or f32); GGUFExportError with the converter's last lines when it fails."""
    check_convertible(folder)
    if not (Path(target_dir) / "config.json").is_file():
        raise GGUFExportError(f"{target_dir} is not the target's Hugging Face folder (no config.json): the converter "
                              "takes the target's tokenizer and layer count from it")
    command = [sys.executable, str(converter), str(folder), "--target-model-dir", str(target_dir),
               "--outfile", str(out), "--outtype", dtype, "--model-name", "draftops EAGLE-3 draft"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not out.is_file():
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:])
        raise GGUFExportError(f"llama.cpp's {Path(converter).name} failed on {folder}:\n{tail}")
    return out


TENSOR_NAMES = {"fc.weight": "fc.weight", "lm_head.weight": "output.weight", "norm.weight": "output_norm.weight",
                "layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
                "layers.0.hidden_norm.weight": "blk.0.attn_norm_2.weight",
                "layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
                "layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
                "layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
                "layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
                "layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
                "layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
                "layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",
                "layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight", "d2t": "d2t"}  # speculators -> GGUF


def check_eagle3_gguf(path: Path, folder: Path, dtype: str = "f16") -> None:
    """Read the EAGLE-3 GGUF at `path` back against the speculators folder it was made from: its architecture,
    target layers and hidden size, and every tensor (q and k in GGUF's rotary layout, llama.cpp's permutation;
    equal to float32 rounding for f32, to 1e-3 of the largest weight for f16; d2t, which the GGUF holds as the head
    rows' target ids, exactly). GGUFExportError otherwise."""
    config = json.loads((folder / "config.json").read_text())
    layer = config["transformer_layer_config"]
    reader = gguf.GGUFReader(path)
    fields = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("tokenizer.")}
    expected = {"general.architecture": "eagle3", "eagle3.target_layers": config["eagle_aux_hidden_state_layer_ids"],
                "eagle3.target_hidden_size": config.get("target_hidden_size") or layer["hidden_size"]}
    if wrong := {key: fields.get(key) for key, value in expected.items() if fields.get(key) != value}:
        raise GGUFExportError(f"{path}: {wrong}, expected {expected}")
    stored = {t.name: t for t in reader.tensors}
    heads = {"q_proj": layer["num_attention_heads"],
             "k_proj": layer.get("num_key_value_heads") or layer["num_attention_heads"]}
    tolerance = 1e-6 if dtype == "f32" else 1e-3
    for name, want in load_file(folder / "model.safetensors").items():
        if name not in TENSOR_NAMES:  # t2d: llama.cpp maps draft rows to target ids with d2t alone
            continue
        if TENSOR_NAMES[name] not in stored:
            raise GGUFExportError(f"{path} has no {TENSOR_NAMES[name]} (the draft's {name})")
        got = torch.from_numpy(np.array(stored[TENSOR_NAMES[name]].data))
        if name == "d2t":  # speculators: offsets (id = row + d2t[row]); llama.cpp's GGUF: the target ids themselves
            if not torch.equal(got.long(), want.long() + torch.arange(len(want))):
                raise GGUFExportError(f"{path}: its d2t is not the draft head's target ids")
            continue
        projection = name.split(".")[-2]
        want = rope_permute(want, heads[projection]) if projection in heads else want
        got, want = got.double(), want.double()
        if got.shape != want.shape or float((got - want).abs().max()) > tolerance * max(float(want.abs().max()), 1):
            raise GGUFExportError(f"{path}: {TENSOR_NAMES[name]} {tuple(got.shape)} is not the draft's {name} "
                                  f"{tuple(want.shape)}")

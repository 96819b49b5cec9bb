"""A feature draft on disk in the `speculators` Eagle3 format, which vLLM serves as it is (`vllm serve <folder>`).

A folder holds `config.json` (an `Eagle3SpeculatorConfig`: the draft layer's Llama config, the target layers read, the
draft vocabulary size and the verifier it was trained for) and `model.safetensors` with the draft's own weights under
the names `decode.models.feature_draft.FeatureDraft` already uses. The token embeddings are the target's and are not
written: vLLM shares the verifier's when a draft has none, and `speculators` reads them from the verifier. A reduced
head also gets speculators' vocabulary maps: `d2t` [draft_vocab] int64 holds the offset `target_id - draft_row` (target
id = row + d2t[row]) and `t2d` [target_vocab] bool marks the target ids the head covers; a full-vocabulary head has
neither, as speculators saves it.

`norm_before_residual` is written as the draft has it (`FeatureDraft`'s option; vLLM reads a missing one as true,
speculators as false, so it is always written); `norm_before_fc`, `fc_norm` and `norm_output` are written false (what
`FeatureDraft` computes), and a folder that sets any of those is refused on load.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from decode.models.feature_draft import FeatureDraft
from pipeline.files import swap_dir, temporary_sibling
from pipeline.sources import is_speculators_dir

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
SHARED = "embed_tokens.weight"  # the target's embeddings: never written, ignored when a folder has them
UNSUPPORTED = ("norm_before_fc", "fc_norm", "norm_output")  # variants FeatureDraft lacks


def increasing(layers) -> bool:
    """Whether the target layers read are distinct and in order: vLLM hands the draft each captured layer's state once,
    in layer order, and speculators refuses repeated ids, so other orders cannot be served."""
    return all(a < b for a, b in zip(layers, layers[1:]))


def vocab_maps(token_ids: torch.Tensor, target_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """speculators' (d2t, t2d) of a reduced head whose rows are the sorted target ids `token_ids`."""
    token_ids = token_ids.long().cpu()
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[token_ids] = True
    return token_ids - torch.arange(len(token_ids)), t2d


def save_speculators(draft: FeatureDraft, path, *, verifier_name_or_path: str,
                     verifier_architectures: list[str] | None = None, speculative_tokens: int = 3) -> Path:
    """Write `draft` as a speculators Eagle3 folder at `path` for the verifier `verifier_name_or_path` (the id or
    folder a server loads as target), proposing `speculative_tokens` tokens a round by default. Written in a
    temporary sibling and swapped in (`pipeline.files`): a stopped write leaves the previous folder whole."""
    if speculative_tokens < 1:
        raise ValueError(f"speculative_tokens must be at least 1, got {speculative_tokens}")
    if not increasing(draft.feature_layers):
        raise ValueError(f"feature layers {list(draft.feature_layers)} are not strictly increasing: servers capture "
                         f"each target layer once, in layer order")
    config, rows = draft.config, draft.lm_head.out_features
    # speculators writes the layer config as transformers' diff; the shapes a reader needs are spelled out
    layer = config.to_diff_dict() | {"model_type": "llama", "num_hidden_layers": 1, "tie_word_embeddings": False,
                                     "hidden_size": config.hidden_size, "vocab_size": config.vocab_size}
    architectures = verifier_architectures if verifier_architectures is not None else draft.target_architectures
    speculator = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "transformer_layer_config": layer, "draft_vocab_size": rows, "target_hidden_size": config.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(draft.feature_layers), **dict.fromkeys(UNSUPPORTED, False),
        "norm_before_residual": bool(draft.norm_before_residual),
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "verifier": {"name_or_path": verifier_name_or_path, "architectures": list(architectures)}},
    }
    tensors = {name: value.detach().cpu().contiguous() for name, value in draft.state_dict().items() if name != SHARED}
    if draft.token_ids is not None:
        tensors["d2t"], tensors["t2d"] = vocab_maps(draft.token_ids, config.vocab_size)
    path = Path(path)
    tmp = temporary_sibling(path)
    tmp.mkdir()
    (tmp / CONFIG_FILE).write_text(json.dumps(speculator, indent=2, sort_keys=True) + "\n")
    save_file(tensors, tmp / WEIGHTS_FILE, metadata={"format": "pt"})
    return swap_dir(tmp, path)


def saved_feature_layers(path) -> tuple[int, ...]:
    """The target layers the Eagle3 folder at `path` reads (its `eagle_aux_hidden_state_layer_ids`), read from its
    config alone; ValueError where it names none."""
    path = Path(path)
    if not is_speculators_dir(path):
        raise ValueError(f"{path} is not a speculators export (no {CONFIG_FILE} naming a speculators_model_type)")
    layers = tuple(json.loads((path / CONFIG_FILE).read_text()).get("eagle_aux_hidden_state_layer_ids") or ())
    if not layers:
        raise ValueError(f"{path} names no target layers to read (eagle_aux_hidden_state_layer_ids)")
    return layers


def load_speculators(path, target) -> FeatureDraft:
    """The `FeatureDraft` saved at `path`, over `target`'s embeddings, on its device and in its dtype (the draft reads
    the target's embeddings and features). ValueError when `path` is not an Eagle3 export `FeatureDraft` can run or
    was made for a target of other hidden or vocabulary size."""
    path = Path(path)
    if not is_speculators_dir(path) or not (path / WEIGHTS_FILE).is_file():
        raise ValueError(f"{path} is not a speculators export (no {CONFIG_FILE} naming a speculators_model_type, or "
                         f"no {WEIGHTS_FILE})")
    saved = json.loads((path / CONFIG_FILE).read_text())
    if saved["speculators_model_type"] != "eagle3":
        raise ValueError(f"{path} is a speculators {saved['speculators_model_type']!r} export, not eagle3")
    layer = saved["transformer_layer_config"]
    if layer.get("model_type") != "llama" or layer.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{path}: only a one-layer llama draft is supported, got {layer.get('num_hidden_layers')} "
                         f"{layer.get('model_type')!r} layer(s)")
    if flags := [flag for flag in UNSUPPORTED if saved.get(flag)]:
        raise ValueError(f"{path} sets {flags}, which FeatureDraft does not compute")
    config = LlamaConfig.from_dict({k: v for k, v in layer.items() if k != "model_type"})
    target_config = target.config.get_text_config(decoder=True)
    hidden, vocab = target_config.hidden_size, target_config.vocab_size
    if config.hidden_size != hidden or saved.get("target_hidden_size") not in (None, hidden):
        raise ValueError(f"hidden size mismatch: {path} was made for {saved.get('target_hidden_size')} (layer "
                         f"{config.hidden_size}), the target has {hidden}")
    if config.vocab_size != vocab:
        raise ValueError(f"vocab mismatch: {path} was made for a target of {config.vocab_size} tokens, the target "
                         f"has {vocab}")
    layers = tuple(saved.get("eagle_aux_hidden_state_layer_ids") or ())
    if not layers or not increasing(layers) or not 0 <= layers[0] <= layers[-1] < target_config.num_hidden_layers:
        raise ValueError(f"{path} reads target layers {list(layers)}, the target has {target_config.num_hidden_layers}")
    tensors = load_file(path / WEIGHTS_FILE)
    tensors.pop(SHARED, None)
    d2t, t2d = tensors.pop("d2t", None), tensors.pop("t2d", None)
    token_ids = None if d2t is None else torch.arange(len(d2t)) + d2t
    rows = vocab if token_ids is None else len(token_ids)
    if saved.get("draft_vocab_size") != rows or (token_ids is None) != (t2d is None) or (
            t2d is not None and not torch.equal(t2d.nonzero().flatten(), token_ids)):
        raise ValueError(f"{path}: draft_vocab_size {saved.get('draft_vocab_size')}, d2t and t2d disagree")
    embed = target.get_input_embeddings()
    draft = FeatureDraft(config, embed, feature_layers=layers, token_ids=token_ids,
                         norm_before_residual=bool(saved.get("norm_before_residual", False)))
    verifier = saved.get("speculators_config", {}).get("verifier", {})
    draft.target_architectures = list(verifier.get("architectures") or [])
    missing, unexpected = draft.load_state_dict(tensors, strict=False)
    if set(missing) - {SHARED} or unexpected:
        raise ValueError(f"{path}: weights missing {sorted(set(missing) - {SHARED})}, unexpected {unexpected}")
    draft.to(embed.weight.device)
    for part in (draft.fc, draft.layers, draft.norm, draft.lm_head):  # not embed_tokens (the target's), not rotary
        part.to(embed.weight.dtype)
    return draft.eval()

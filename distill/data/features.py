"""The target's features for a feature draft's training (`decode.models.feature_draft`): the hidden states entering the
read layers at every position of every training sequence (prompt + response), from batched teacher-forced passes,
cached next to the responses they belong to.

Recomputing them on every training step would run the whole target again each step (the feature draft itself is one
layer); one pass over the data, stored fp16 (len(layers) · hidden · 2 bytes a token) and read back by the batches,
costs that once per data set. The file is keyed by the layers read and the number of responses it covers
(`features-<layers>-x<n>.safetensors` in the response cache folder) and is replaced whole, like the response cache.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from decode.runtime.forward import target_features
from distill.data.responses import ResponseSet
from pipeline.files import TMP_SUFFIX

log = logging.getLogger(__name__)


def features_file(cache_dir: Path, layers: tuple[int, ...], n_sequences: int) -> Path:
    return cache_dir / f"features-{'-'.join(map(str, layers))}-x{n_sequences}.safetensors"


@torch.inference_mode()
def teacher_forced_features(model, sequences: list[list[int]], layers: tuple[int, ...], *, batch_size: int = 16,
                            progress: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [Σ len, len(layers) · H] fp16 on the CPU, offsets [n + 1]) of every position of every sequence,
    in the order given; batches of similar lengths, right-padded (causal: padding after a sequence changes nothing
    before it)."""
    device = next(model.parameters()).device
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    rows: dict[int, torch.Tensor] = {}
    batches = [order[b : b + batch_size] for b in range(0, len(order), batch_size)]
    for batch in tqdm(batches, desc="target features", unit="batch", disable=not progress):
        width = max(len(sequences[i]) for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, : len(sequences[i])] = torch.tensor(sequences[i])
            mask[row, : len(sequences[i])] = 1
        out = model.model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True)
        features = target_features(out.hidden_states, layers).half().cpu()
        for row, i in enumerate(batch):
            rows[i] = features[row, : len(sequences[i])]
    lengths = torch.tensor([0] + [len(s) for s in sequences])
    return torch.cat([rows[i] for i in range(len(sequences))]), lengths.cumsum(0)


def cached_features(model, responses: ResponseSet, cache_dir: Path, layers: tuple[int, ...], *,
                    progress: bool = False) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """`teacher_forced_features` of the responses' prompt + response sequences, read from the cache folder when an
    earlier job computed them, else taken from the responses when the target recorded them as it generated
    (`distill.data.responses.cached_responses(capture=...)`), else computed; written to the cache either way. Returns
    (features, offsets, whether from the cache)."""
    sequences = [p + r for p, r in zip(responses.prompt_ids, responses.response_ids)]
    path = features_file(cache_dir, layers, len(sequences))
    lengths = [0] + [len(s) for s in sequences]
    recorded = (responses.features is not None
                and responses.feature_offsets.tolist() == torch.tensor(lengths).cumsum(0).tolist())
    if path.exists():
        try:
            saved = load_file(str(path))
            if saved["offsets"].tolist() == torch.tensor(lengths).cumsum(0).tolist():
                return saved["features"], saved["offsets"], True
            log.warning("%s does not fit these responses; computed again", path)
        except Exception as exc:  # a damaged file: computed again
            log.warning("damaged feature cache %s (%s); computed again", path, exc)
    if recorded:
        features, offsets = responses.features, responses.feature_offsets
    else:
        features, offsets = teacher_forced_features(model, sequences, layers, progress=progress)
    tmp = path.with_name(f"{path.name}{TMP_SUFFIX}{os.getpid()}")  # renamed into place: never half a file
    save_file({"features": features.contiguous(), "offsets": offsets}, str(tmp))
    os.replace(tmp, path)
    return features, offsets, False

"""The target's features for a feature draft's training (`decode.models.feature_draft`): the hidden states entering the
read layers at every position of every training sequence (prompt + response), from batched teacher-forced passes,
cached next to the responses they belong to.

Recomputing them on every training step would run the whole target again each step (the feature draft itself is one
layer); one pass over the data, stored fp16 (len(layers) · hidden · 2 bytes a token) and read back by the batches,
costs that once per data set. The file is keyed by the layers read and the number of responses it covers
(`features-<layers>-x<n>.safetensors` in the response cache folder) and is replaced whole, like the response cache.
With teacher=final the target's final hidden states and log-normalizers are cached the same way (`final-x<n>`).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from decode.models.architectures import head_logits
from decode.runtime.forward import target_features
from distill.data.responses import ResponseSet
from pipeline.files import TMP_SUFFIX

log = logging.getLogger(__name__)


def features_file(cache_dir: Path, layers: tuple[int, ...], n_sequences: int) -> Path:
    return cache_dir / f"features-{'-'.join(map(str, layers))}-x{n_sequences}.safetensors"


def final_file(cache_dir: Path, n_sequences: int) -> Path:
    return cache_dir / f"final-x{n_sequences}.safetensors"


@torch.inference_mode()
def _teacher_forced(model, sequences: list[list[int]], rows_of, *, batch_size: int, progress: bool,
                    desc: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows_of(ids, mask) [B, T, F] of every position of every sequence, concatenated in the order given; offsets
    [n + 1]); batches of similar lengths, right-padded (causal: padding after a sequence changes nothing before it)."""
    device = next(model.parameters()).device
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    rows: dict[int, torch.Tensor] = {}
    batches = [order[b : b + batch_size] for b in range(0, len(order), batch_size)]
    for batch in tqdm(batches, desc=desc, unit="batch", disable=not progress):
        width = max(len(sequences[i]) for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, : len(sequences[i])] = torch.tensor(sequences[i])
            mask[row, : len(sequences[i])] = 1
        values = rows_of(ids.to(device), mask.to(device))
        for row, i in enumerate(batch):
            rows[i] = values[row, : len(sequences[i])]
    lengths = torch.tensor([0] + [len(s) for s in sequences])
    return torch.cat([rows[i] for i in range(len(sequences))]), lengths.cumsum(0)


def teacher_forced_features(model, sequences: list[list[int]], layers: tuple[int, ...], *, batch_size: int = 16,
                            progress: bool = False, dtype: torch.dtype = torch.float16
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [Σ len, len(layers) · H] on the CPU, offsets [n + 1]) of every position of every sequence."""
    def rows_of(ids, mask):
        out = model.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        return target_features(out.hidden_states, layers).to(dtype).cpu()
    return _teacher_forced(model, sequences, rows_of, batch_size=batch_size, progress=progress,
                           desc="target features")


def teacher_forced_final(model, sequences: list[list[int]], *, batch_size: int = 16, progress: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(final hidden states [Σ len, H] fp16, log-normalizers [Σ len] fp32, offsets [n + 1]): what the target's
    distribution at every position is rebuilt from over any rows of its head (`distill.step.final_teacher`)."""
    def rows_of(ids, mask):
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        # one sequence's [T, V] logits at a time, not the batch's [B, T, V]
        log_z = torch.stack([torch.logsumexp(head_logits(model, h).float(), -1) for h in hidden])
        return torch.cat([hidden.float(), log_z[..., None]], -1).cpu()
    rows, offsets = _teacher_forced(model, sequences, rows_of, batch_size=batch_size, progress=progress,
                                    desc="target final states")
    return rows[:, :-1].half(), rows[:, -1].contiguous(), offsets


def _read_cache(path: Path, offsets: list[int]) -> dict[str, torch.Tensor] | None:
    """The cached tensors at `path` when they cover these sequences; None (a warning when there was a file) else."""
    if not path.exists():
        return None
    try:
        saved = load_file(str(path))
        if saved["offsets"].tolist() == offsets:
            return saved
        log.warning("%s does not fit these responses; computed again", path)
    except Exception as exc:  # a damaged file: computed again
        log.warning("damaged cache %s (%s); computed again", path, exc)
    return None


def _write_cache(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    tmp = path.with_name(f"{path.name}{TMP_SUFFIX}{os.getpid()}")  # renamed into place: never half a file
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)


def cached_features(model, responses: ResponseSet, cache_dir: Path, layers: tuple[int, ...], *,
                    progress: bool = False) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """`teacher_forced_features` of the responses' prompt + response sequences, read from the cache folder when an
    earlier job computed them, else taken from the responses when the target recorded them as it generated
    (`distill.data.responses.cached_responses(capture=...)`), else computed; written to the cache either way. Returns
    (features, offsets, whether from the cache)."""
    sequences = [p + r for p, r in zip(responses.prompt_ids, responses.response_ids)]
    path = features_file(cache_dir, layers, len(sequences))
    offsets = torch.tensor([0] + [len(s) for s in sequences]).cumsum(0).tolist()
    saved = _read_cache(path, offsets)
    if saved is not None:
        return saved["features"], saved["offsets"], True
    if responses.features is not None and responses.feature_offsets.tolist() == offsets:
        features, offsets = responses.features, responses.feature_offsets
    else:
        features, offsets = teacher_forced_features(model, sequences, layers, progress=progress)
    _write_cache(path, {"features": features, "offsets": offsets})
    return features, offsets, False


def heldout_features(model, responses: ResponseSet, layers: tuple[int, ...]) -> None:
    """The target's features of the held-out responses, kept on them at the target's own precision: a job evaluates
    its draft on the same responses every `eval_every` steps, and one target pass serves every evaluation."""
    key = (id(model), tuple(layers))
    if responses.features is not None and responses.feature_key == key:
        return
    sequences = [p + r for p, r in zip(responses.prompt_ids, responses.response_ids)]
    responses.features, responses.feature_offsets = teacher_forced_features(
        model, sequences, layers, dtype=next(model.parameters()).dtype)
    responses.feature_key = key


def cached_final(model, responses: ResponseSet, cache_dir: Path, *, progress: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """`teacher_forced_final` of the responses' sequences, cached as the features are. Returns (final hidden
    states, log-normalizers, whether from the cache)."""
    sequences = [p + r for p, r in zip(responses.prompt_ids, responses.response_ids)]
    path = final_file(cache_dir, len(sequences))
    offsets = torch.tensor([0] + [len(s) for s in sequences]).cumsum(0).tolist()
    saved = _read_cache(path, offsets)
    if saved is not None:
        return saved["hidden"], saved["log_z"], True
    hidden, log_z, offsets = teacher_forced_final(model, sequences, progress=progress)
    _write_cache(path, {"hidden": hidden, "log_z": log_z, "offsets": offsets})
    return hidden, log_z, False

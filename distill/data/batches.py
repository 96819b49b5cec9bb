"""Training batches from a `ResponseSet`: which examples each optimizer step and micro-batch takes, and the
padded tensors (input ids, response-position mask, labels, cached top-k teacher) built from them.

The data order of step s is a pure function of (seed, s), so a resumed run continues with the batches an
uninterrupted one would have seen, and any (processes × accumulation) split of a global batch covers the same
examples.
"""
from __future__ import annotations

import torch

from decode.sampling import to_student_columns
from distill.data.responses import ResponseSet
from distill.losses import TopKTeacher


def global_batch_indices(n_examples: int, step: int, global_batch: int, seed: int,
                         lengths: list[int] | None = None, group: int = 8) -> list[int]:
    """Example indices of optimizer step `step`: epoch e is a permutation seeded by (seed, e); the tail is dropped.

    With `lengths`, each run of `group` global batches of the permutation is sorted by length before it is cut
    (HF's group_by_length idea), so micro-batches hold similar lengths and little padding.
    """
    steps_per_epoch = n_examples // global_batch
    epoch, within = divmod(step, steps_per_epoch)
    order = torch.randperm(n_examples, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()
    order = order[:steps_per_epoch * global_batch]
    if lengths is not None:
        span = group * global_batch
        begin = within // group * span
        order[begin:begin + span] = sorted(order[begin:begin + span], key=lambda i: (-lengths[i], i))
    return order[within * global_batch:(within + 1) * global_batch]


def micro_batch(indices: list[int], micro: int, rank: int, num_processes: int, batch_size: int) -> list[int]:
    """Micro-batch `micro` of process `rank`: consecutive slices, so any (processes × accumulation) split of the
    same global batch covers the same examples."""
    begin = (micro * num_processes + rank) * batch_size
    return indices[begin:begin + batch_size]


def collate(responses: ResponseSet, indices: list[int], *, pad_id: int, token_ids: torch.Tensor | None,
            with_teacher: bool, topk: int, with_features: bool = False, with_final: bool = False) -> dict:
    """Right-padded batch of prompt+response sequences.

    loss_mask[b, j] is True where position j predicts a response token (j = start-1 … len-2); labels hold that next
    token in student columns; teacher (if asked) holds the cached top-k at those positions, ids mapped to columns;
    features (if asked) the target's cached features at every position (fp32, zeros on padding); final and
    final_log_z (if asked) its cached final hidden states and log-normalizers there (teacher=final).
    """
    seqs = [responses.prompt_ids[i] + responses.response_ids[i] for i in indices]
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(len(seqs), width, dtype=torch.long)
    loss_mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    next_tokens = torch.full((len(seqs), width), -100, dtype=torch.long)
    values = torch.full((len(seqs), width, topk), float("-inf"), dtype=torch.float16) if with_teacher else None
    columns = torch.full((len(seqs), width, topk), -1, dtype=torch.int32) if with_teacher else None
    for row, (i, seq) in enumerate(zip(indices, seqs)):
        start, end = len(responses.prompt_ids[i]), len(seq)
        input_ids[row, :end] = torch.tensor(seq)
        attention_mask[row, :end] = 1
        loss_mask[row, start - 1:end - 1] = True
        next_tokens[row, start - 1:end - 1] = torch.tensor(responses.response_ids[i])
        if with_teacher:  # a cache of fewer than topk columns (a server's smaller k) leaves the rest to the tail
            lp, ids = responses.teacher_rows(i)
            kept = min(topk, lp.shape[1])
            values[row, start - 1:end - 1, :kept] = lp[:, :kept]
            columns[row, start - 1:end - 1, :kept] = ids[:, :kept]
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask,
             "labels": to_student_columns(next_tokens, token_ids)}
    if with_teacher:
        batch["teacher"] = TopKTeacher(values, to_student_columns(columns.long(), token_ids, ignore_index=-1))
    if with_features:
        features = torch.zeros(len(seqs), width, responses.features.shape[1])
        for row, i in enumerate(indices):
            features[row, : len(seqs[row])] = responses.feature_rows(i).float()
        batch["features"] = features
    if with_final:
        final = torch.zeros(len(seqs), width, responses.final_hidden.shape[1])
        log_z = torch.zeros(len(seqs), width)
        for row, i in enumerate(indices):
            hidden, z = responses.final_rows(i)
            final[row, : len(seqs[row])], log_z[row, : len(seqs[row])] = hidden.float(), z
        batch["final"], batch["final_log_z"] = final, log_z
    return batch

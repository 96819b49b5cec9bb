"""The loss step: one micro-batch through the draft, scored against the teacher at its response positions.

torchtune KD recipe shape: the loop (distill.loop) owns gradient accumulation, synchronization, the optimizer and
checkpoints; this is only "forward, then loss", so it can be tested on a batch written by hand.
"""
from __future__ import annotations

import torch

from distill.losses import TopKTeacher, distillation_loss
from pipeline.config import DistillConfig


class ResponseLogits(torch.nn.Module):
    """The draft's logits at the masked (response) positions only, [N, V_draft]: the head and the loss skip prompt
    and padding positions. The module accelerate wraps (DDP), so gradient sync still sees every parameter."""

    def __init__(self, draft):
        super().__init__()
        self.draft = draft

    def forward(self, input_ids, attention_mask, loss_mask):
        hidden = self.draft.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.draft.lm_head(hidden[loss_mask])


def response_teacher(batch: dict, target, device) -> torch.Tensor | TopKTeacher:
    """The teacher at the batch's response positions, [N, ...]: its cached top-k if the batch carries one, else the
    target's logits on the batch (the online teacher; on-policy batches have no cache)."""
    loss_mask = batch["loss_mask"]
    if "teacher" in batch:
        teacher = batch["teacher"][loss_mask]
        return TopKTeacher(teacher.logprobs.to(device), teacher.indices.to(device))
    with torch.no_grad():
        return target(input_ids=batch["input_ids"].to(device),
                      attention_mask=batch["attention_mask"].to(device)).logits[loss_mask.to(device)]


def loss_step(model, batch: dict, settings: DistillConfig, *, num_tokens: int | torch.Tensor,
              token_ids: torch.Tensor | None, device: torch.device | str, target=None) -> torch.Tensor:
    """This micro-batch's share of the step loss: `settings.loss` (+ `ce_weight` · cross-entropy) between the
    teacher and `model`'s logits at the response positions, in fp32, summed and divided by `num_tokens`.

    model: a `ResponseLogits` (or its accelerate wrapper). batch: a `distill.batches.collate` batch. num_tokens:
    the response tokens of the whole global batch (every process, every micro-batch), so that the summed
    gradients are those of the global per-token mean whatever the split. target: the online teacher, used when
    the batch carries no cached top-k.
    """
    teacher = response_teacher(batch, target, device)
    loss_mask = batch["loss_mask"].to(device)
    logits = model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                   loss_mask=loss_mask)
    return distillation_loss(logits, teacher, loss=settings.loss, beta=settings.jsd_beta,
                             temperature=settings.temperature, token_ids=token_ids,
                             labels=batch["labels"].to(device)[loss_mask], ce_weight=settings.ce_weight,
                             num_tokens=num_tokens)

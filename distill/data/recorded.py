"""Training data from recorded replies (`distill.responses.source: recorded`): the assistant replies a production
log holds, with the teacher's top-k from one batched teacher-forced pass of the target, no sampling loop.

Only right when the log was served by the target itself: `traffic.served_by` names that model (the target's
fingerprint or its source as configured), and any other is refused (`RecordedMismatch`), since another model's replies
are not what this target says. A reply is tokenized as the chat template renders it after its prompt (its end of
turn included, as a generated response keeps its EOS), cut after the first stop token and to
`distill.max_new_tokens`. The cache entry's key names its source, so recorded and generated data never mix.
"""
from __future__ import annotations

from pathlib import Path

import torch

from distill.data.responses import (
    DamagedCache,
    ResponseSet,
    load_responses,
    prompts_hash,
    response_cache_dir,
    response_set,
    save_responses,
)
from pipeline.files import recover_dir
from pipeline.prompts import PromptStyle, render, styled_message
from pipeline.traffic import Request

LOGITS_BYTES_PER_BATCH = 1 << 30  # the teacher-forced pass's logits of one batch, fp32


class RecordedMismatch(ValueError):
    """Recorded replies asked for where the log was not served by the target: one line, exit 2."""


def served_by_target(served_by: str | None, target_source: str, fingerprint: str) -> bool:
    """Whether `traffic.served_by` names the target: its fingerprint, its source, or the source's last part."""
    return served_by is not None and served_by in {fingerprint, target_source, Path(target_source).name}


def check_served_by(served_by: str | None, target_source: str, fingerprint: str) -> None:
    if served_by is None:
        raise RecordedMismatch("distill.responses.source=recorded needs traffic.served_by: the model the log was "
                               f"served by (the target's source {target_source!r} or its fingerprint {fingerprint})")
    if not served_by_target(served_by, target_source, fingerprint):
        raise RecordedMismatch(f"traffic.served_by={served_by!r} is not the target ({target_source}, fingerprint "
                               f"{fingerprint}): its replies are another model's; use distill.responses.source="
                               "generate")


def reply_ids(request: Request, tokenizer, style: PromptStyle | None, stop_ids: list[int],
              max_new_tokens: int) -> list[int]:
    """The logged reply as token ids: the text the template adds for it after the prompt (or, where the template
    renders the conversation otherwise, its content and the EOS token), to its first stop token."""
    prompt = render(request.messages, tokenizer, style, request.tools)
    full = render([*request.messages, request.reply], tokenizer, style, request.tools, generation_prompt=False)
    if full.startswith(prompt):
        text = full[len(prompt):]
    else:
        reply = styled_message(request.reply, style.reasoning if style is not None else "template")
        text = reply["content"] + (tokenizer.eos_token or "")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    end = next((i + 1 for i, token in enumerate(ids) if token in stop_ids), len(ids))
    return ids[:min(end, max_new_tokens)] or stop_ids[:1]


@torch.inference_mode()
def batched_teacher_topk(model, prompts: list[list[int]], replies: list[list[int]], k: int,
                         batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The target's top-k log-probs at every reply token, by forwards of right-padded batches of similar lengths (at
    most `batch_size` rows, and as many as keep a batch's logits near `LOGITS_BYTES_PER_BATCH`)."""
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]) + len(replies[i]))
    rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    begin = 0
    while begin < len(order):
        width = len(prompts[order[-1]]) + len(replies[order[-1]])
        fit = max(1, min(batch_size, LOGITS_BYTES_PER_BATCH // (4 * vocab * width)))
        batch = order[begin:begin + fit]
        begin += fit
        width = max(len(prompts[i]) + len(replies[i]) for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, i in enumerate(batch):
            seq = prompts[i] + replies[i]
            ids[row, :len(seq)] = torch.tensor(seq)
            mask[row, :len(seq)] = 1
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        for row, i in enumerate(batch):
            start, end = len(prompts[i]), len(prompts[i]) + len(replies[i])
            values, indices = torch.log_softmax(logits[row, start - 1:end - 1].float(), -1).topk(k, dim=-1)
            rows[i] = (values.half().cpu(), indices.int().cpu())
    return [rows[i] for i in range(len(prompts))]


def recorded_responses(model, tokenizer, target_fingerprint: str, requests: list[Request], prompts: list[list[int]],
                       *, style: PromptStyle | None, stop_ids: list[int], max_new_tokens: int, topk: int,
                       batch_size: int) -> tuple[ResponseSet, Path, bool]:
    """The logged replies to `prompts` with the target's top-k, cached (`sample-0/` of an entry keyed by the prompts,
    the replies and `source: recorded`): (responses, cache dir, whether it came from the cache)."""
    replies = [reply_ids(r, tokenizer, style, stop_ids, max_new_tokens) for r in requests]
    key = prompts_hash(prompts, replies=replies, source="recorded")
    path = response_cache_dir(target_fingerprint, key)
    part_dir = recover_dir(path / "sample-0")
    if part_dir.exists():
        try:
            part = load_responses(part_dir)
            if part.topk_indices.shape[1] >= topk:
                part.topk_logprobs, part.topk_indices = part.topk_logprobs[:, :topk], part.topk_indices[:, :topk]
                return part, path, True
        except DamagedCache:
            pass  # made again below
    responses = response_set(prompts, replies, batched_teacher_topk(model, prompts, replies, topk, batch_size))
    responses.request_ids = [f"{r.id}#0" for r in requests]
    save_responses(responses, part_dir)
    return responses, path, False

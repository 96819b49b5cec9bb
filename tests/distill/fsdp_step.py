"""The data and draft of the FSDP2 test (tests/distill/test_loop.py, tests/distill/fsdp_ranks.py): one global batch
of 4 cached target responses, split over the ranks, and a seeded tiny draft."""
from __future__ import annotations

import torch

from distill.data.batches import collate, micro_batch
from distill.data.responses import ResponseSet, generate_responses
from pipeline.config import DistillConfig
from tests.conftest import make_tiny_model, make_tokenizer

GLOBAL_BATCH = 4
SETTINGS = DistillConfig(learning_rate=0.5, max_grad_norm=0.02, topk=4)  # a norm the gradient exceeds: clipping acts
PROMPTS = ["what is the sum", "write code to explain", "how to translate the code", "why is a sum of",
           "explain the code", "translate what is"]


def responses() -> ResponseSet:
    tokenizer = make_tokenizer()
    target = make_tiny_model(len(tokenizer), seed=0)
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    return generate_responses(target, tokenizer, prompts, max_new_tokens=6, temperature=1.0, batch_size=6, seed=0,
                              topk=SETTINGS.topk)


def tiny_draft():
    return make_tiny_model(len(make_tokenizer()), seed=1, layers=2)


def heldout_and_batches(rank: int, world: int) -> tuple[ResponseSet, list[dict], int]:
    """(held-out set, this rank's micro-batches of the one global batch, response tokens of the global batch)."""
    data = responses()
    heldout = ResponseSet(data.request_ids[4:], data.prompt_ids[4:], data.response_ids[4:],
                          *_teacher_rows(data, range(4, len(data))))
    indices, size = list(range(GLOBAL_BATCH)), GLOBAL_BATCH // world
    batches = [collate(data, micro_batch(indices, 0, rank, world, size), pad_id=0, token_ids=None,
                       with_teacher=True, topk=SETTINGS.topk)]
    num_tokens = sum(len(data.response_ids[i]) for i in indices)
    return heldout, batches, num_tokens


def _teacher_rows(data: ResponseSet, rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    values, ids = zip(*(data.teacher_rows(i) for i in rows))
    offsets = torch.tensor([0] + [len(v) for v in values]).cumsum(0)
    return torch.cat(values), torch.cat(ids), offsets

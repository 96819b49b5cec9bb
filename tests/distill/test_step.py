import math
from types import SimpleNamespace

import pytest
import torch

from distill.losses import TopKTeacher
from distill.step import loss_step
from pipeline.config import DistillConfig

NEG_INF = float("-inf")


class UniformDraft(torch.nn.Module):
    """A stand-in for `ResponseLogits`: equal logits over 3 draft columns (q = 1/3 each) at every response position."""

    def __init__(self):
        super().__init__()
        self.logits = torch.nn.Parameter(torch.zeros(3))
        self.seen_masks = []

    def forward(self, input_ids, attention_mask, loss_mask):
        self.seen_masks.append(loss_mask)
        return self.logits.expand(int(loss_mask.sum()), -1)


def one_response_position(teacher: TopKTeacher | None = None) -> dict:
    """Prompt [1, 5] and response [7]: position 1 predicts the response token (label: draft column 0); position 0
    (the prompt) and 2 (padding) carry a teacher that must be ignored."""
    batch = {"input_ids": torch.tensor([[1, 5, 7, 0]]), "attention_mask": torch.tensor([[1, 1, 1, 0]]),
             "loss_mask": torch.tensor([[False, True, False, False]]), "labels": torch.tensor([[-100, 0, -100, -100]])}
    if teacher is not None:
        batch["teacher"] = teacher
    return batch


def cached_top1() -> TopKTeacher:
    """The cached teacher keeps only its top-1 at each position: column 0 with p = 1/2 at the response position."""
    return TopKTeacher(torch.tensor([[[0.0], [math.log(0.5)], [NEG_INF], [NEG_INF]]]),
                       torch.tensor([[[2], [0], [-1], [-1]]]))


def online_target(input_ids, attention_mask):
    """The target's logits on the batch: p = (1/2, 1/4, 1/4) at the response position, something else elsewhere."""
    logits = torch.tensor([[[5.0, 0.0, 0.0], [math.log(0.5), math.log(0.25), math.log(0.25)], [0.0, 5.0, 0.0],
                            [0.0, 0.0, 5.0]]])
    return SimpleNamespace(logits=logits)


def step(batch, num_tokens, target=None, **settings):
    draft = UniformDraft()
    loss = loss_step(draft, batch, DistillConfig(**settings), num_tokens=num_tokens, token_ids=None, device="cpu",
                     target=target)
    assert torch.equal(draft.seen_masks[0], batch["loss_mask"])
    return draft, loss


def test_loss_step_with_the_cached_top_k_teacher_is_the_bucketed_divergence_over_the_global_token_count():
    # buckets: the cached column 0 and the tail. p = (1/2, 1/2), q = (1/3, 2/3)
    # forward KL = 1/2 ln(3/2) + 1/2 ln(3/4) = 1/2 ln(9/8); over 4 tokens of the global batch
    _, loss = step(one_response_position(cached_top1()), num_tokens=4)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(0.5 * math.log(9 / 8) / 4, abs=1e-7)
    # TVD = 1 − (min(1/2, 1/3) + min(1/2, 2/3)) = 1/6
    _, loss = step(one_response_position(cached_top1()), num_tokens=1, loss="tvd")
    assert loss.item() == pytest.approx(1 / 6, abs=1e-6)
    # + 0.5 · cross-entropy on the response token (draft column 0, q = 1/3): 0.5 ln 3
    _, loss = step(one_response_position(cached_top1()), num_tokens=2, loss="tvd", ce_weight=0.5)
    assert loss.item() == pytest.approx((1 / 6 + 0.5 * math.log(3)) / 2, abs=1e-6)


def test_loss_step_with_the_online_teacher_runs_the_target_and_gives_the_gradient_of_the_token_mean():
    # full vocabulary: p = (1/2, 1/4, 1/4), q = (1/3, 1/3, 1/3)
    # forward KL = 1/2 ln(3/2) + 2 · 1/4 ln(3/4) = 1/2 ln(9/8), as with the cached top-1 (same coarse-grained p)
    draft, loss = step(one_response_position(), num_tokens=4, target=online_target)
    assert loss.item() == pytest.approx(0.5 * math.log(9 / 8) / 4, abs=1e-7)
    loss.backward()
    # d KL(p ‖ softmax(z)) / dz = q − p, divided by the global token count
    torch.testing.assert_close(draft.logits.grad, torch.tensor([1 / 3 - 1 / 2, 1 / 3 - 1 / 4, 1 / 3 - 1 / 4]) / 4)
    _, loss = step(one_response_position(), num_tokens=1, target=online_target, loss="tvd")
    assert loss.item() == pytest.approx(1 - (1 / 3 + 1 / 4 + 1 / 4), abs=1e-6)

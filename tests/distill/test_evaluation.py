"""Held-out evaluation helpers with hand-computed values."""
from __future__ import annotations

import torch

from distill.evaluation import draft_ranks


def test_draft_ranks_place_target_ids_in_the_draft_order():
    probs = torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]])
    # full vocabulary: id 2 is second at the first position, id 0 first at the second
    assert draft_ranks(probs, torch.tensor([2, 0]), None).tolist() == [2, 1]
    # a reduced head over target ids 2, 5, 7: 7 is column 2 (second), 4 is outside (0), 5 is column 1 (third)
    assert draft_ranks(probs, torch.tensor([7, 4]), torch.tensor([2, 5, 7])).tolist() == [2, 0]
    assert draft_ranks(probs, torch.tensor([5, 5]), torch.tensor([2, 5, 7])).tolist() == [1, 3]

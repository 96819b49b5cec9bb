import torch

from distill.weight_average import WeightAverage


def test_the_average_follows_each_step_by_hand_and_is_held_only_inside_applied():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    average = WeightAverage([w], decay=0.75)
    with torch.no_grad():
        w.copy_(torch.tensor([5.0, 6.0]))
    average.update()  # 0.75 · [1, 2] + 0.25 · [5, 6]
    with torch.no_grad():
        w.copy_(torch.tensor([9.0, 10.0]))
    average.update()  # 0.75 · [2, 3] + 0.25 · [9, 10]
    with average.applied():
        torch.testing.assert_close(w.detach(), torch.tensor([3.75, 4.75]))
    torch.testing.assert_close(w.detach(), torch.tensor([9.0, 10.0]))


def test_a_restored_average_continues_where_the_saved_one_was():
    w = torch.nn.Parameter(torch.tensor([1.0]))
    saved = WeightAverage([w], decay=0.5)
    with torch.no_grad():
        w.fill_(3.0)
    saved.update()
    restored = WeightAverage([w], decay=0.5)
    restored.load_state_dict(saved.state_dict())
    restored.update()
    with restored.applied():
        torch.testing.assert_close(w.detach(), torch.tensor([2.5]))  # 0.5 · 2 + 0.5 · 3

import math

import torch

from decode.sampling import sample, to_target_vocab, warp_logits

LOGITS = torch.log(torch.tensor([0.1, 0.4, 0.2, 0.3]))


def test_temperature_one_is_softmax():
    assert torch.allclose(warp_logits(LOGITS, 1.0), torch.tensor([0.1, 0.4, 0.2, 0.3]))


def test_temperature_zero_is_one_hot_argmax():
    assert warp_logits(LOGITS, 0.0).tolist() == [0.0, 1.0, 0.0, 0.0]


def test_temperature_sharpens():
    probs = warp_logits(LOGITS, 0.5)  # p^2 renormalised
    expected = torch.tensor([0.01, 0.16, 0.04, 0.09]) / 0.30
    assert torch.allclose(probs, expected)


def test_top_k_keeps_k_largest():
    probs = warp_logits(LOGITS, 1.0, top_k=2)
    assert torch.allclose(probs, torch.tensor([0.0, 0.4, 0.0, 0.3]) / 0.7)


def test_top_p_keeps_smallest_prefix_reaching_p():
    # sorted: 0.4, 0.3, 0.2, 0.1 -> mass before each: 0, 0.4, 0.7, 0.9
    assert torch.allclose(warp_logits(LOGITS, 1.0, top_p=0.7), torch.tensor([0.0, 0.4, 0.0, 0.3]) / 0.7)
    assert torch.allclose(warp_logits(LOGITS, 1.0, top_p=0.75), torch.tensor([0.0, 0.4, 0.2, 0.3]) / 0.9)
    assert warp_logits(LOGITS, 1.0, top_p=0.01).tolist() == [0.0, 1.0, 0.0, 0.0]


def test_top_k_then_top_p_batched_and_fp32():
    logits = torch.stack([LOGITS, LOGITS.flip(0)]).double()
    probs = warp_logits(logits, 1.0, top_k=3, top_p=0.5)
    assert probs.dtype == torch.float32
    # top-3 renormalised: 0.4/0.9, 0.3/0.9, 0.2/0.9 -> mass before: 0, 0.444, 0.777 -> keep two
    assert torch.allclose(probs[0], torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]))
    assert torch.allclose(probs[1], torch.tensor([3 / 7, 0.0, 4 / 7, 0.0]))


def test_sample_follows_probs():
    probs = torch.tensor([0.1, 0.4, 0.2, 0.3])
    generator = torch.Generator().manual_seed(0)
    draws = sample(probs.expand(20000, 4), generator)
    freq = torch.bincount(draws, minlength=4).float() / 20000
    assert torch.allclose(freq, probs, atol=0.015)
    assert sample(torch.tensor([0.0, 0.0, 1.0, 0.0]), generator).item() == 2


def test_to_target_vocab_scatters():
    token_ids = torch.tensor([1, 4, 5])
    full = to_target_vocab(torch.tensor([[0.2, 0.3, 0.5]]), token_ids, 6)
    assert torch.equal(full, torch.tensor([[0.0, 0.2, 0.0, 0.0, 0.3, 0.5]]))
    assert to_target_vocab(LOGITS, None, 4) is LOGITS
    assert math.isclose(full.sum().item(), 1.0)

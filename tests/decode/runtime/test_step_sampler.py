"""The generator's per-step sampler (`decode.runtime.step_sampler`) against the straightforward full-vocabulary way."""
import torch

from decode.runtime.step_sampler import BLOCK, inverse_cdf_sample, topk_log_probs


def reference_draw(logits, temperatures, uniforms):
    """softmax(logits / T), its running sum in fp64 over the whole vocabulary, the first id past u."""
    cdf = torch.softmax(logits.double() / temperatures[:, None].double(), -1).cumsum(-1)
    draws = uniforms.double()[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, draws, right=True)[:, 0].clamp(max=logits.shape[-1] - 1)


def test_topk_log_probs_are_log_softmax_topk():
    logits = torch.randn(5, 1000) * 4
    values, ids = topk_log_probs(logits, 7)
    want_values, want_ids = torch.log_softmax(logits, -1).topk(7, dim=-1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(values, want_values, atol=1e-5, rtol=0)


def test_draws_equal_the_full_inverse_cdf_for_vocabularies_off_the_block_size():
    torch.manual_seed(0)
    for vocab in (BLOCK, 3 * BLOCK, 1000, 49_152 + 7):
        logits = torch.randn(64, vocab) * 3
        logits[:, ::5] = float("-inf")  # masked ids are never drawn
        temperatures = torch.rand(64) + 0.3
        uniforms = torch.rand(64, dtype=torch.float64)
        drawn = inverse_cdf_sample(logits, temperatures, uniforms)
        assert torch.equal(drawn, reference_draw(logits, temperatures, uniforms)), vocab
        assert not bool((drawn % 5 == 0).any())


def test_the_ends_of_the_unit_interval_draw_the_first_and_last_possible_ids():
    logits = torch.full((2, 600), float("-inf"))
    logits[:, [3, 300, 555]] = torch.tensor([1.0, 2.0, 0.5])
    drawn = inverse_cdf_sample(logits, torch.ones(2), torch.tensor([0.0, 1 - 1e-12], dtype=torch.float64))
    assert drawn.tolist() == [3, 555]


def test_a_row_draws_the_same_alone_or_beside_others_and_logits_stay_untouched():
    torch.manual_seed(1)
    logits = torch.randn(6, 700)
    kept = logits.clone()
    temperatures, uniforms = torch.full((6,), 0.8), torch.rand(6, dtype=torch.float64)
    together = inverse_cdf_sample(logits, temperatures, uniforms)
    alone = [int(inverse_cdf_sample(logits[i : i + 1], temperatures[i : i + 1], uniforms[i : i + 1])) for i in range(6)]
    assert together.tolist() == alone
    assert torch.equal(logits, kept)

"""pipeline.intervals: paired comparisons."""
import pytest


def test_paired_ratio_difference_is_paired_over_prompts():
    from pipeline.intervals import paired_ratio_difference
    # b accepts exactly 0.1 less than a on every prompt, whatever the prompt's own level: a paired interval is tight
    a = [(0.6 * n, n) for n in (10, 20, 30, 40, 50)] + [(0.2 * n, n) for n in (10, 20, 30, 40, 50)]
    b = [(x - 0.1 * n, n) for x, n in a]
    out = paired_ratio_difference(a, b)
    assert out["a"] == pytest.approx(0.4) and out["b"] == pytest.approx(0.3)
    assert out["difference"]["value"] == pytest.approx(0.1)
    assert out["difference"]["low"] == pytest.approx(0.1) and out["difference"]["high"] == pytest.approx(0.1)
    assert out["ratio"]["value"] == pytest.approx(0.4 / 0.3)

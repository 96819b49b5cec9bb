"""SGLang's speculative-decoding gauges and counters, parsed from data/sglang_metrics.txt: a /metrics page in the
format SGLang documents (prometheus_client's text: HELP/TYPE lines, `_created` gauges of its counters, a histogram),
with its speculative gauges and counters set by hand."""
import re
from pathlib import Path

import pytest

from monitor.fleet.counters import ServerMetricsError
from monitor.fleet.sglang import SglangGauges, gauge_window, is_sglang, parse_sglang

SGLANG = (Path(__file__).parent.parent / "data" / "sglang_metrics.txt").read_text()
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def with_rank(text: str, rate: float, verify: float) -> str:
    """A second data-parallel rank: every speculative sample again with dp_rank="1", its own rate and counter."""
    def again(match):
        line = match.group(0)
        name_labels, value = line.rsplit(" ", 1)
        other = name_labels.replace("{", '{dp_rank="1",', 1)
        new = rate if "accept_rate" in name_labels else verify if "verify_calls_total" in name_labels else value
        return f"{line}\n{other} {new}"

    return re.sub(r"^sglang:spec_(accept_\w+|verify_calls_total)\{.*$", again, text, flags=re.M)


def test_the_recorded_page_gives_its_gauges_and_counters():
    assert is_sglang(SGLANG)
    assert parse_sglang(SGLANG) == SglangGauges(0.625, 2.875, 100000.0, 287500.0)
    assert parse_sglang(SGLANG, MODEL).accept_rate == 0.625
    with pytest.raises(ServerMetricsError, match=f"model names seen: {re.escape(MODEL)}"):
        parse_sglang(SGLANG, "other")
    without = "\n".join(line for line in SGLANG.splitlines() if "spec_accept_rate" not in line)
    with pytest.raises(ServerMetricsError, match="--enable-metrics and a --speculative-algorithm"):
        parse_sglang(without)


def test_ranks_gauges_are_averaged_and_counters_summed():
    two = parse_sglang(with_rank(SGLANG, 0.575, 50000.0))
    assert two.accept_rate == pytest.approx(0.6) and two.verify_calls == 150000.0


def test_a_gauge_window_is_its_sample_weighted_one_and_idle_when_the_verify_counter_stood_still():
    before = parse_sglang(SGLANG)
    busy = SglangGauges(0.58, 2.7, 101200.0, 290000.0)
    window, restarted = gauge_window(before, busy)
    assert (window.engine, window.draft_tokens, window.accepted, window.drafts, restarted) == \
        ("sglang", 1.0, 0.58, 1200.0, False)
    assert window.gauge and window.acceptance == 0.58
    idle, _ = gauge_window(busy, SglangGauges(0.58, 2.7, 101200.0, 290000.0))
    assert idle.draft_tokens == 0  # the gauge kept its last value: not a window
    again, restarted = gauge_window(busy, SglangGauges(0.6, 2.8, 300.0, 900.0))
    assert restarted and again.drafts == 300.0 and again.draft_tokens == 1.0
    no_counter, _ = gauge_window(SglangGauges(0.6, 2.8), SglangGauges(0.61, 2.8))
    assert no_counter.draft_tokens == 1.0  # without the counter an idle server cannot be told apart
    assert gauge_window(None, busy) == (None, False)

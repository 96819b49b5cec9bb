"""SGLang's speculative-decoding metrics (`--enable-metrics`), which are gauges rather than counters.

SGLang exports, labelled with `model_name` (and its parallelism ranks):

    sglang:spec_accept_rate          gauge: accepted / drafted tokens over the decode steps of the last logging
                                     interval (its "recent average"), the acceptance the monitor tests
    sglang:spec_accept_length        gauge: tokens per verification step over that interval, the bonus token included
    sglang:spec_verify_calls_total   counter (newer versions): verification steps since the start
    sglang:generation_tokens_total   counter: output tokens since the start"""
# What a gauge window can and cannot tell. A counter's difference between two scrapes holds every draft token of the
# window, and the window test weighs each window by them. A gauge is a recent average at the moment of the scrape: it
# holds no token counts, says nothing about the traffic between two samples, and keeps its last value while the server
# is idle. So a window of SGLang is the gauge's sample(s) in it (one per scrape of the monitor's own store; Prometheus'
# `avg_over_time` over the window, every sample its scrapes took), weighted 1: the drop test then works on the windows'
# mean acceptance rates, unweighted, which is weaker than counters (a quiet window counts as much as a busy one, and a
# sample covers only the last logging interval's decode steps). Where `spec_verify_calls_total` exists, a window in
# which
# it did not move is idle (not kept) and its drop below the previous scrape is a restart; without it an idle server's
# stale gauge is read as a window like any other. The per-position counters of vLLM and llama.cpp have no SGLang
# counterpart.
#
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from prometheus_client.parser import text_string_to_metric_families

from monitor.fleet.counters import GAUGE_ENGINE, ServerMetricsError, SpecCounters

ACCEPT_RATE = "sglang:spec_accept_rate"
ACCEPT_LENGTH = "sglang:spec_accept_length"
VERIFY_CALLS = "sglang:spec_verify_calls_total"
GENERATION_TOKENS = "sglang:generation_tokens_total"


@dataclass(frozen=True)
class SglangGauges:
    """One scrape of SGLang: the two gauges (averaged over label sets) and the counters, when exported (summed)."""

    accept_rate: float
    accept_length: float
    verify_calls: float | None = None
    generation_tokens: float | None = None

    def to_dict(self) -> dict:
        return {"engine": GAUGE_ENGINE, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict) -> SglangGauges:
        return cls(float(data["accept_rate"]), float(data["accept_length"]), data.get("verify_calls"),
                   data.get("generation_tokens"))

    def window_since(self, previous: object) -> tuple[SpecCounters | None, bool]:
        """`gauge_window` this reading and the replica's previous one (none, or another kind: no window)."""
        return gauge_window(previous if isinstance(previous, SglangGauges) else None, self)


def reading_from_dict(data: dict) -> SpecCounters | SglangGauges:
    """A stored reading (`to_dict`) of either kind."""
    return SglangGauges.from_dict(data) if data.get("engine") == GAUGE_ENGINE else SpecCounters.from_dict(data)


def is_sglang(text: str) -> bool:
    """Whether an exposition holds SGLang's acceptance gauge (what `kind: auto` looks for)."""
    return ACCEPT_RATE in text


def parse_sglang(text: str, model_name: str | None = None) -> SglangGauges:
    """SGLang's speculative-decoding gauges and counters in a Prometheus text exposition (label sets of `model_name`
    only, when given): gauges averaged over label sets (data-parallel ranks), counters summed."""
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise ServerMetricsError(f"not a Prometheus text exposition: {exc}") from None
    values: dict[str, list[float]] = {}
    models: set[str] = set()
    names = (ACCEPT_RATE, ACCEPT_LENGTH, VERIFY_CALLS, GENERATION_TOKENS)
    for sample in (s for family in families for s in family.samples if s.name in names):
        if model_name is not None and sample.labels.get("model_name") != model_name:
            models.add(sample.labels.get("model_name", "(none)"))
            continue
        values.setdefault(sample.name, []).append(sample.value)
    if ACCEPT_RATE not in values:
        if models:
            raise ServerMetricsError(f"no SGLang acceptance gauge with model_name={model_name!r}; model names seen: "
                                     f"{', '.join(sorted(models))}")
        raise ServerMetricsError(f"no {ACCEPT_RATE} gauge: is SGLang started with --enable-metrics and a "
                                 "--speculative-algorithm?")

    def mean(name: str) -> float:
        return sum(values[name]) / len(values[name]) if values.get(name) else math.nan

    def total(name: str) -> float | None:
        return sum(values[name]) if name in values else None

    return SglangGauges(mean(ACCEPT_RATE), mean(ACCEPT_LENGTH), total(VERIFY_CALLS), total(GENERATION_TOKENS))


def gauge_window(previous: SglangGauges | None, current: SglangGauges) -> tuple[SpecCounters | None, bool]:
    """(the window this scrape closes, whether the server restarted since `previous`), as `counters.window_between`:
    no window without a previous scrape. The window is the current gauge sample, weight 1 (`accepted` the rate,
    `draft_tokens` 1; `drafts` the verification steps when counted); an idle one (the verify counter did not move)
    has weight 0."""
    if previous is None:
        return None, False
    restarted = False
    steps = 0.0
    weight = 1.0
    if current.verify_calls is not None and previous.verify_calls is not None:
        restarted = current.verify_calls < previous.verify_calls
        steps = current.verify_calls if restarted else current.verify_calls - previous.verify_calls
        weight = 1.0 if steps > 0 else 0.0
    rate = current.accept_rate if math.isfinite(current.accept_rate) else 0.0
    if not math.isfinite(current.accept_rate):
        weight = 0.0
    return SpecCounters(GAUGE_ENGINE, steps, weight, rate * weight), restarted

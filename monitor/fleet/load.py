"""What each replica is carrying: its running requests and the tokens per second it generates, where its engine
reports them. The canary compares tokens per second (monitor.check.canary); the boundary watch compares running
requests with the concurrency where speculation stopped paying (monitor.check.boundary).

    engine     running requests (gauge)          tokens per second
    vLLM       vllm:num_requests_running          1 / mean of vllm:time_per_output_token_seconds (histogram)
    llama.cpp  llamacpp:requests_processing       llamacpp:predicted_tokens_seconds (gauge, since the server started)
    SGLang     sglang:num_running_reqs            sglang:gen_throughput (gauge)

From Prometheus (monitor.prometheus_url) each is averaged over the last `monitor.prometheus_window`
(`avg_over_time` of a gauge, `rate` of the histogram's sum over its count); without it, the figures of one scrape of
each configured replica (vLLM's histogram then averages since the server started). A replica that reports neither,
or cannot be read, is left out: these figures never decide a verdict on their own.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

from prometheus_client.parser import text_string_to_metric_families

from monitor.fleet.counters import ServerMetricsError, scrape
from monitor.fleet.prometheus import PrometheusError, _selector, api_get, query_instant
from pipeline.config import DraftopsConfig

RUNNING = {"vllm": "vllm:num_requests_running", "llamacpp": "llamacpp:requests_processing",
           "sglang": "sglang:num_running_reqs"}
SPEED_GAUGES = {"llamacpp": "llamacpp:predicted_tokens_seconds", "sglang": "sglang:gen_throughput"}
VLLM_TPOT = "vllm:time_per_output_token_seconds"


@dataclass(frozen=True)
class EngineLoad:
    """One replica's running requests and tokens per second (None: not reported)."""

    running: float | None = None
    tokens_per_second: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def parse_load(text: str, model_name: str | None = None) -> EngineLoad:
    """Running requests and tokens per second in one metrics page (summed over label sets, of `model_name` only when
    given; the speed gauges averaged)."""
    sums: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if model_name is not None and sample.labels.get("model_name", model_name) != model_name:
                continue
            sums.setdefault(sample.name, []).append(sample.value)
    running = next((sum(sums[n]) for n in RUNNING.values() if n in sums), None)
    speed = next((sum(sums[n]) / len(sums[n]) for n in SPEED_GAUGES.values() if n in sums), None)
    seconds, count = sum(sums.get(VLLM_TPOT + "_sum", [])), sum(sums.get(VLLM_TPOT + "_count", []))
    if speed is None and seconds > 0 and count > 0:
        speed = count / seconds
    return EngineLoad(_finite(running), _finite(speed))


def _by_replica(cfg: DraftopsConfig, query: str, at: float, get) -> dict[str, float]:
    """{replica: value} of an instant query whose series are one per replica (the query aggregates `by` the label)."""
    label, names = cfg.monitor.prometheus_replica_label, {e.name for e in cfg.monitor.engines}
    out: dict[str, list[float]] = {}
    for series in query_instant(cfg.monitor.prometheus_url, query, at, cfg.monitor.server_timeout, get):
        replica = series["metric"].get(label)
        value = float(series["value"][1])
        if replica is not None and (not names or replica in names) and math.isfinite(value):
            out.setdefault(replica, []).append(value)
    return {k: sum(v) / len(v) for k, v in out.items()}


def prometheus_load(cfg: DraftopsConfig, at: float, get: Callable = api_get) -> dict[str, EngineLoad]:
    """Each replica's load over the last window, from Prometheus (module docstring)."""
    w, label = cfg.monitor.prometheus_window, cfg.monitor.prometheus_replica_label
    running_regex = "|".join(RUNNING.values())
    speed_regex = "|".join(SPEED_GAUGES.values())
    running = _by_replica(cfg, f"sum by ({label}) (avg_over_time({_selector(cfg, regex=running_regex)}[{w}]))",
                          at, get)
    speed = _by_replica(cfg, f"avg by ({label}) (avg_over_time({_selector(cfg, regex=speed_regex)}[{w}]))", at, get)
    tpot = _by_replica(cfg, f"sum by ({label}) (rate({_selector(cfg, VLLM_TPOT + '_sum')}[{w}])) / sum by ({label}) "
                            f"(rate({_selector(cfg, VLLM_TPOT + '_count')}[{w}]))", at, get)
    for replica, seconds in tpot.items():
        if replica not in speed and seconds > 0:
            speed[replica] = 1.0 / seconds
    return {r: EngineLoad(running.get(r), speed.get(r)) for r in sorted(set(running) | set(speed))}


def scraped_load(cfg: DraftopsConfig, fetch: Callable[[str, float], str] | None = None) -> dict[str, EngineLoad]:
    """Each configured replica's load in one scrape of its metrics page (module docstring)."""
    out = {}
    for endpoint in cfg.monitor.replica_endpoints():
        if endpoint.url is None:
            continue
        try:
            out[endpoint.name] = parse_load((fetch or scrape)(endpoint.url, cfg.monitor.server_timeout),
                                            endpoint.model)
        except (ServerMetricsError, ValueError):
            continue
    return out


def read_load(cfg: DraftopsConfig, at: float, *, fetch: Callable | None = None, get: Callable = api_get
              ) -> tuple[dict[str, EngineLoad], str | None]:
    """({replica: its load}, why none could be read, or None): from Prometheus when configured, else a scrape."""
    if cfg.monitor.prometheus_url:
        try:
            return prometheus_load(cfg, at, get), None
        except PrometheusError as exc:
            return {}, str(exc)
    return scraped_load(cfg, fetch), None

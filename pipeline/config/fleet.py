"""`monitor.engines:`: the serving engines (replicas) whose speculative-decoding acceptance the monitor reads, and the
duration syntax of `monitor.prometheus_window`."""
from __future__ import annotations

import re
import urllib.parse
from typing import Literal

from pydantic import Field, model_validator

from pipeline.config.base import HttpUrl, Section

DURATION = re.compile(r"(\d+)([smhdw])")
SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def duration_seconds(text: str) -> int:
    """A Prometheus duration of one unit (`90s`, `15m`, `1h`, `1d`) in seconds; ValueError otherwise."""
    match = DURATION.fullmatch(text.strip())
    if not match or int(match[1]) == 0:
        raise ValueError(f"{text!r} is not a Prometheus duration of one unit (e.g. 15m, 1h, 1d)")
    return int(match[1]) * SECONDS[match[2]]


class EngineEndpoint(Section):
    """One serving replica: a vLLM, SGLang or llama-server process (or a pod), read through its /metrics or through
    Prometheus under its replica label."""

    url: HttpUrl | None = Field(None, description=(
        "The replica's Prometheus endpoint (vLLM /metrics, SGLang --enable-metrics /metrics, llama-server --metrics). "
        "Needed unless monitor.prometheus_url is set (the post-deploy engine check always reads it directly)."))
    kind: Literal["auto", "vllm", "sglang", "llamacpp"] = Field("auto", description=(
        "Which engine exports the counters; auto: whichever the exposition holds."))
    replica: str | None = Field(None, description=(
        "Its name in reports; with Prometheus, the value of monitor.prometheus_replica_label that selects its "
        "series. null: the URL's host:port."))
    model: str | None = Field(None, description=(
        "Read only the label sets whose model_name is this (vLLM, SGLang); null: the sum over all."))
    per_core: bool = Field(False, description=(
        "vLLM data-parallel servers label each engine core (engine=\"0\", \"1\", ...): true reads every core as a "
        "replica of its own (named REPLICA/engine=N), false sums them."))

    @model_validator(mode="after")
    def _named(self) -> EngineEndpoint:
        if self.url is None and self.replica is None:
            raise ValueError("an engine needs a url or a replica name")
        return self

    @property
    def name(self) -> str:
        if self.replica:
            return self.replica
        parsed = urllib.parse.urlsplit(self.url or "")
        return parsed.netloc or str(self.url)


def unique_names(endpoints: list[EngineEndpoint], prometheus: bool) -> None:
    """ValueError when two endpoints share a name, or one without a URL is configured without Prometheus."""
    names = [e.name for e in endpoints]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"monitor.engines: replica names must differ ({', '.join(twice)} twice): set `replica`")
    if not prometheus:
        missing = [e.name for e in endpoints if e.url is None]
        if missing:
            raise ValueError(f"monitor.engines: {', '.join(missing)} without a url (needed unless "
                             "monitor.prometheus_url is set)")

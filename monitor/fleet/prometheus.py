"""Windows of every replica from Prometheus' HTTP API (`monitor.prometheus_url`), where the team's Prometheus already
scrapes the engines: the first check has a baseline's worth of windows, and windows can be hours.

Queries. One window is `increase(<counter>[W])` evaluated at its end, W = `monitor.prometheus_window`; a range query
(`GET /api/v1/query_range?query=...&start=...&end=...&step=W`) gives consecutive, non-overlapping windows, for every
series at once. `increase` handles counter resets (a restarted engine) and extrapolates to the window's edges, so a
window's counts are not whole numbers. Queried: the three counters and the per-position one of vLLM and llama.cpp
(`{__name__=~"(vllm|llamacpp):spec_decode_..._total", <selector>}`), SGLang's acceptance gauge as
`avg_over_time(sglang:spec_accept_rate[W])` and its `increase(sglang:spec_verify_calls_total[W])`
(monitor.fleet.sglang says what a gauge window can tell); at the check's time, not the last window's end, `count
by (__name__, <label>)` of the series (which engine a replica runs; one with series but no closed window yet is
collecting) and `up` (a replica whose last scrape failed is unreachable). The answer is `{"status": "success",
"data": {"resultType": "matrix", "result": [...]}}`; an error answer's `errorType` and `error` are reported as they
are."""
# Replicas. The value of `monitor.prometheus_replica_label` (instance, pod, ...) names a series' replica; with
# `monitor.engines` listed, a replica's series are those whose label equals its name (and, with its `model`,
# whose `model_name` is that; with `per_core`, split by vLLM's `engine` label into NAME/engine=N), and a listed
# replica with no series is unreachable; without, every label value found is a replica.
#
# Versions. Windows end on multiples of W (a check and the next see the same windows). Which windows belong to the
# champion version is kept in `<monitor.state_dir>/prometheus_windows.json`: the first check ever takes the last
# baseline + recent windows as served by the champion of the moment (the history before installation); a version that
# becomes champion later owns the windows that end after the next boundary (the window in progress spans the change);
# a version that becomes champion again (rollback) keeps its baseline and takes recent windows from its return on.
# Baseline: its first `server_baseline_windows` windows with draft tokens, kept in the state file once complete (per
# replica) and read from there ever after; recent: the last `server_recent_windows` after them. A change of source (URL,
# window, label or selector) keeps the spans and the stored baselines: the new source's windows are judged against
# them, never taken as a baseline (`draftops monitor rebaseline` starts one afresh, on the operator's word). A
# range longer than Prometheus' 11,000 points per series is read as two ranges (its first windows, its last ones).
#
from __future__ import annotations

import http.client
import json
import math
import time
import urllib.parse
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from monitor.fleet.counters import COUNTERS, ENGINES, GAUGE_ENGINE, PER_POSITION, ServerMetricsError, SpecCounters
from monitor.fleet.sglang import ACCEPT_RATE, VERIFY_CALLS
from monitor.fleet.window_store import ReplicaWindows, Window
from pipeline.config import DraftopsConfig
from pipeline.config.fleet import EngineEndpoint, duration_seconds
from pipeline.deadline_http import DeadlinePassed, exchange, origin
from pipeline.files import write_text_atomic

STATE_FILE = "prometheus_windows.json"
MAX_STEPS = 10000  # Prometheus answers at most 11,000 points per series
MAX_ANSWER_BYTES = 256 << 20  # a range query over every series of a large fleet
Get = Callable[[str, float], dict]


class PrometheusError(ServerMetricsError):
    """Prometheus could not be asked, or answered an error (its errorType and error)."""


def api_get(url: str, timeout: float) -> dict:
    """The JSON answer of a Prometheus API URL, whole within `timeout` seconds (`pipeline.deadline_http`: connecting,
    headers and body; a redirect is not followed); PrometheusError with its error message when it fails."""
    where = origin(url)
    try:
        answer = exchange(url, timeout=timeout, max_bytes=MAX_ANSWER_BYTES)
    except DeadlinePassed:
        raise PrometheusError(f"Prometheus at {where}: no whole answer within {timeout:g} s "
                              "(monitor.server_timeout)") from None
    except (OSError, http.client.HTTPException) as exc:
        raise PrometheusError(f"Prometheus unreachable at {where}: {type(exc).__name__}: {exc}") from None
    except ValueError as exc:
        raise PrometheusError(f"Prometheus: {exc}") from None
    if answer.status != 200:
        body = answer.json()
        detail = f"{body.get('errorType')}: {body.get('error')}" if "error" in body else answer.said()
        raise PrometheusError(f"Prometheus answered HTTP {answer.status}: {detail}")
    try:
        return json.loads(answer.body.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise PrometheusError(f"Prometheus at {where}: the answer is not JSON: {type(exc).__name__}: "
                              f"{str(exc)[:200]}") from None


def _answer(body: dict, kinds: tuple[str, ...]) -> list[dict]:
    if body.get("status") != "success":
        raise PrometheusError(f"Prometheus answered {body.get('errorType')}: {body.get('error')}")
    data = body.get("data") or {}
    if data.get("resultType") not in kinds:
        raise PrometheusError(f"Prometheus answered a {data.get('resultType')}, not a {' or '.join(kinds)}")
    return data.get("result") or []


def query_range(base: str, query: str, start: float, end: float, step: int, timeout: float,
                get: Get = api_get) -> list[dict]:
    """The series of a range query: [{"metric": {labels}, "values": [[t, "v"], ...]}, ...]."""
    params = urllib.parse.urlencode({"query": query, "start": f"{start:.0f}", "end": f"{end:.0f}", "step": step})
    return _answer(get(f"{base.rstrip('/')}/api/v1/query_range?{params}", timeout), ("matrix",))


def query_instant(base: str, query: str, at: float, timeout: float, get: Get = api_get) -> list[dict]:
    """The series of an instant query: [{"metric": {labels}, "value": [t, "v"]}, ...]."""
    params = urllib.parse.urlencode({"query": query, "time": f"{at:.0f}"})
    return _answer(get(f"{base.rstrip('/')}/api/v1/query?{params}", timeout), ("vector",))


def _selector(cfg: DraftopsConfig, name: str = "", regex: str | None = None) -> str:
    """`name{regex, selector}`, with the braces only where they hold a matcher (`up` alone without a selector)."""
    parts = [f'__name__=~"{regex}"'] if regex else []
    parts += [cfg.monitor.prometheus_selector] if cfg.monitor.prometheus_selector.strip() else []
    return f"{name}{{{', '.join(parts)}}}" if parts else name


def _counter_regex(name: str) -> str:
    return f"(?:{'|'.join(ENGINES)}):{name}"


def queries(cfg: DraftopsConfig) -> dict[str, str]:
    """The range queries of one reading, by what they give."""
    w = cfg.monitor.prometheus_window
    out = {key: f"increase({_selector(cfg, regex=_counter_regex(name))}[{w}])"
           for key, name in (*COUNTERS.items(), ("per_pos", PER_POSITION))}
    out["gauge"] = f"avg_over_time({_selector(cfg, ACCEPT_RATE)}[{w}])"
    out["verify_calls"] = f"increase({_selector(cfg, VERIFY_CALLS)}[{w}])"
    return out


def state_path(cfg: DraftopsConfig) -> Path:
    return Path(cfg.monitor.state_dir).resolve() / STATE_FILE


def _source(cfg: DraftopsConfig) -> dict:
    m = cfg.monitor
    return {"url": m.prometheus_url, "window": m.prometheus_window, "label": m.prometheus_replica_label,
            "selector": m.prometheus_selector}


def load_state(cfg: DraftopsConfig) -> dict:
    """The state file's content: the source, the champion, each version's span and stored baselines."""
    path = state_path(cfg)
    return json.loads(path.read_text()) if path.exists() else {"source": _source(cfg), "champion": None,
                                                               "versions": {}}


def save_state(cfg: DraftopsConfig, state: dict) -> None:
    path = state_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(state, indent=1))


def _spans(cfg: DraftopsConfig, champion_version: str, end: float, now: float) -> tuple[dict, dict, list[str]]:
    """(state, the champion version's span: {"since", "resumed", "baselines"}, notes), the state file updated; a
    changed source keeps every span and stored baseline (module docstring)."""
    m, step = cfg.monitor, duration_seconds(cfg.monitor.prometheus_window)
    state, source = load_state(cfg), _source(cfg)
    notes = []
    if state.get("source") != source:
        changed = ", ".join(f"{k} {state.get('source', {}).get(k)!r} -> {v!r}" for k, v in source.items()
                            if state.get("source", {}).get(k) != v)
        notes.append(f"Prometheus source changed ({changed}): the stored baselines are kept and the new source's "
                     "windows judged against them (draftops monitor rebaseline to start afresh)")
        state["source"] = source
    next_boundary = math.ceil(now / step) * step
    versions = state["versions"]
    if champion_version not in versions:
        first = state["champion"] is None
        since = end - (m.server_baseline_windows + m.server_recent_windows) * step if first else next_boundary
        versions[champion_version] = {"since": since, "resumed": since, "baselines": {}}
        if first:
            n = m.server_baseline_windows + m.server_recent_windows
            notes.append(f"first reading from Prometheus: the last {n} windows are taken as served by version "
                         f"{champion_version}")
    elif state["champion"] != champion_version:
        versions[champion_version]["resumed"] = next_boundary
    state["champion"] = champion_version
    save_state(cfg, state)
    return state, versions[champion_version], notes


def _ranges(first: float, end: float, step: int) -> list[tuple[float, float]]:
    if (end - first) / step <= MAX_STEPS:
        return [(first, end)]
    return [(first, first + (MAX_STEPS // 2) * step), (end - (MAX_STEPS // 2) * step, end)]


def _replica_of(metric: dict, label: str, endpoints: list[EngineEndpoint]) -> str | None:
    """The replica a series belongs to (None: not one of the listed replicas, or not of its model)."""
    value = metric.get(label)
    if value is None:
        return None
    if not endpoints:
        return value
    for e in endpoints:
        if e.name == value and (e.model is None or metric.get("model_name") == e.model):
            return f"{value}/engine={metric['engine']}" if e.per_core and "engine" in metric else value
    return None


def _collect(series_by_query: dict[str, list[dict]], label: str, endpoints: list[EngineEndpoint]) -> dict:
    """{replica: {t: {key: value, "pos": {i: value}}}} summed over a replica's series (gauges: averaged)."""
    out: dict[str, dict[float, dict]] = {}
    for key, series in series_by_query.items():
        for s in series:
            replica = _replica_of(s.get("metric", {}), label, endpoints)
            if replica is None:
                continue
            for t, raw in s.get("values", []):
                value = float(raw)
                if not math.isfinite(value):
                    continue
                slot = out.setdefault(replica, {}).setdefault(float(t), {})
                if key == "per_pos":
                    position = s["metric"].get("position", "")
                    if position.isdigit():
                        pos = slot.setdefault("pos", {})
                        pos[int(position)] = pos.get(int(position), 0.0) + value
                elif key == "gauge":
                    slot.setdefault("gauge", []).append(value)
                else:
                    slot[key] = slot.get(key, 0.0) + value
    return out


def _counters(slot: dict, engine: str) -> SpecCounters | None:
    """One window's SpecCounters from what the queries gave at its end (None: nothing to read there)."""
    if "gauge" in slot:
        rate = sum(slot["gauge"]) / len(slot["gauge"])
        busy = slot.get("verify_calls", 1.0) > 0
        return SpecCounters(GAUGE_ENGINE, slot.get("verify_calls", 0.0), float(busy), rate * busy)
    if not all(k in slot for k in COUNTERS):
        return None
    positions = slot.get("pos", {})
    per_pos = tuple(positions.get(i, 0.0) for i in range(max(positions) + 1)) if positions else ()
    return SpecCounters(engine, slot["drafts"], slot["draft_tokens"], slot["accepted"], per_pos)


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")


def _windows(slots: dict[float, dict], engine: str, version: str, step: int, span: dict, replica: str,
             cfg: DraftopsConfig) -> tuple[list[Window], list[Window], Window | None]:
    """(baseline, recent, latest) windows of one replica for the champion version's span: the baseline the span
    stores once complete (stored now when it just became complete), the recent windows after it."""
    m = cfg.monitor
    windows = [Window(_iso(t - step), _iso(t), version, c) for t, slot in sorted(slots.items())
               if t >= span["since"] + step for c in [_counters(slot, engine)] if c is not None]
    latest = windows[-1] if windows else None
    busy = [w for w in windows if w.counters.draft_tokens > 0]
    resumed = _iso(span["resumed"] + step)
    stored = [Window.from_dict(w) for w in span.setdefault("baselines", {}).get(replica, [])]
    if len(stored) >= m.server_baseline_windows:
        after = [w for w in busy if w.end > stored[-1].end and w.end >= resumed]
        return stored, after[-m.server_recent_windows:], latest
    baseline = busy[:m.server_baseline_windows]
    if len(baseline) == m.server_baseline_windows:
        span["baselines"][replica] = [w.to_dict() for w in baseline]
    after = [w for w in busy[len(baseline):] if w.end >= resumed]
    return baseline, after[-m.server_recent_windows:], latest


def fleet_windows(cfg: DraftopsConfig, champion_version: str, get: Get = api_get, now: float | None = None
                  ) -> dict[str, ReplicaWindows]:
    """Every replica's windows of `champion_version` from Prometheus (module docstring); PrometheusError when
    Prometheus cannot be read."""
    m = cfg.monitor
    step, label, base = duration_seconds(m.prometheus_window), m.prometheus_replica_label, m.prometheus_url
    now = time.time() if now is None else now
    end = math.floor(now / step) * step
    state, span, notes = _spans(cfg, champion_version, end, now)
    first = span["since"] + step
    endpoints = m.replica_endpoints()
    series: dict[str, list[dict]] = {}
    if first <= end:
        for start, stop in _ranges(first, end, step):
            for key, query in queries(cfg).items():
                series.setdefault(key, []).extend(query_range(base, query, start, stop, step, m.server_timeout, get))
    # now, not at the last window's end: a replica that stopped since then is down at this check, and one whose
    # counters Prometheus holds but whose first window has not closed yet is collecting, not unreachable
    engines = _engines(cfg, now, get)
    up = {s["metric"].get(label): float(s["value"][1]) for s in
          query_instant(base, _selector(cfg, "up"), now, m.server_timeout, get)}
    collected = _collect(series, label, endpoints)
    names = [e.name for e in endpoints] if endpoints else sorted(set(collected) | set(engines))
    kinds = {e.name: e.kind for e in endpoints if e.kind != "auto"}
    out: dict[str, ReplicaWindows] = {}
    for name in names:
        replicas = sorted(r for r in collected if r == name or r.startswith(f"{name}/engine=")) or [name]
        for replica in replicas:
            engine = kinds.get(name) or engines.get(name) or (
                GAUGE_ENGINE if any("gauge" in s for s in collected.get(replica, {}).values()) else "counters")
            reading = ReplicaWindows(replica, base, engine, notes=list(notes))
            if up.get(name) == 0.0:
                reading.error = f"Prometheus: up{{{label}=\"{name}\"}} is 0 (its last scrape failed)"
            elif replica not in collected and first <= end and name not in engines:
                reading.error = f"Prometheus holds no speculative-decoding series with {label}=\"{name}\""
            else:
                reading.baseline, reading.recent, reading.latest = _windows(
                    collected.get(replica, {}), engine, champion_version, step, span, replica, cfg)
            out[replica] = reading
    save_state(cfg, state)
    return out


def _engines(cfg: DraftopsConfig, at: float, get: Get) -> dict[str, str]:
    """{replica label value: engine prefix} of the counter (or SGLang gauge) series present at `at`."""
    label = cfg.monitor.prometheus_replica_label
    regex = f"{_counter_regex(COUNTERS['draft_tokens'])}|{ACCEPT_RATE}"
    query = f"count by (__name__, {label}) ({_selector(cfg, regex=regex)})"
    found = query_instant(cfg.monitor.prometheus_url, query, at, cfg.monitor.server_timeout, get)
    return {s["metric"].get(label): s["metric"].get("__name__", "").split(":")[0] for s in found}


def rebaseline(cfg: DraftopsConfig, champion_version: str, now: float | None = None) -> float:
    """Start `champion_version`'s span and baselines afresh at the next window boundary, under the configured source
    (`draftops monitor rebaseline`); that boundary's time."""
    step = duration_seconds(cfg.monitor.prometheus_window)
    boundary = math.ceil((time.time() if now is None else now) / step) * step
    state = load_state(cfg)
    state.update(source=_source(cfg), champion=champion_version)
    state["versions"][champion_version] = {"since": boundary, "resumed": boundary, "baselines": {}}
    save_state(cfg, state)
    return boundary

"""The monitor's own window store: the engines scraped by the monitor itself (no Prometheus), one window per replica
between two scrapes, kept in `<monitor.state_dir>/server_metrics.json`.

Who scrapes. `monitor serve` scrapes every replica every `monitor.scrape_interval_minutes` (`scrape_job`), so that
windows are that long and exist when the nightly check runs; a check scrapes too when the last scrape is older than
that interval (or the interval is 0: one window per check). Every scrape reads all replicas at once, in parallel, so
the replicas' windows share their start and end. The file is written atomically under a file lock (the service's
scrape job and a check may meet).

Per replica, a window is the difference of its counters between two scrapes (`counters.window_between`; SGLang: its
gauge sample, `sglang.gauge_window`), kept under the champion version it was served for. The first
`server_baseline_windows` windows closed while a version is champion are its baseline; the last
`server_recent_windows` after them are its recent windows. A window that spans a change of champion belongs to neither
version and is not kept; a version that becomes champion again (rollback) keeps its baseline and starts its recent
windows afresh. A window without draft tokens (an idle replica) is not kept either. A replica whose URL, model or
kind changes keeps its windows (the new source's are judged against its baseline) and closes its next window at the
scrape after next; `draftops monitor rebaseline` drops a version's windows on the operator's word. vLLM's engine
cores read `per_core` are replicas named `NAME/engine=N`.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from filelock import FileLock

from monitor.fleet.counters import (
    GAUGE_ENGINE,
    ServerMetricsError,
    SpecCounters,
    parse_per_core,
    scrape,
    sum_counters,
)
from monitor.fleet.sglang import SglangGauges, is_sglang, parse_sglang, reading_from_dict
from pipeline import registry
from pipeline.config import DraftopsConfig, load_config
from pipeline.config.fleet import EngineEndpoint
from pipeline.files import write_text_atomic
from pipeline.tracking import setup_mlflow

log = logging.getLogger("draftops.monitor")
STATE_FILE = "server_metrics.json"
FORMAT = 2
LOCK_TIMEOUT = 60.0
Fetch = Callable[[str, float], str]


@dataclass
class Window:
    """One window of one replica, and the champion version it belongs to."""

    start: str
    end: str
    champion_version: str
    counters: SpecCounters
    restarted: bool = False

    def to_dict(self) -> dict:
        return {"start": self.start, "end": self.end, "champion_version": self.champion_version,
                "counters": self.counters.to_dict(), "restarted": self.restarted}

    @classmethod
    def from_dict(cls, data: dict) -> Window:
        return cls(data["start"], data["end"], str(data["champion_version"]),
                   SpecCounters.from_dict(data["counters"]), bool(data.get("restarted", False)))


@dataclass
class ReplicaWindows:
    """What one reading gave for one replica, from the store or from Prometheus: its baseline and recent windows of
    the champion version, the latest window, notes, or the error that left it unread (unreachable)."""

    name: str
    url: str | None = None
    engine: str | None = None
    baseline: list[Window] = field(default_factory=list)
    recent: list[Window] = field(default_factory=list)
    latest: Window | None = None
    notes: list[str] = field(default_factory=list)
    error: str | None = None


def store_path(cfg: DraftopsConfig) -> Path:
    return Path(cfg.monitor.state_dir).resolve() / STATE_FILE


def load_store(path: Path) -> dict:
    """The store's content; an empty store when there is none (or one of another format)."""
    if path.exists():
        store = json.loads(path.read_text())
        if store.get("format") == FORMAT:
            return store
    return {"format": FORMAT, "scraped_at": None, "replicas": {}}


def replica_state(store: dict, name: str, source: dict) -> dict:
    """The replica's recorded scrapes and windows. When its source (url, model, kind) changed, its baselines and
    recent windows are kept (the new source's windows are judged against them) and its next scrape starts afresh
    (counters of another source cannot be subtracted from the last)."""
    state = store["replicas"].get(name)
    if state is None:
        state = store["replicas"][name] = {"source": source, "last": None, "versions": {}}
    elif state.get("source") != source:
        state.update(source=source, last=None)
    return state


def rebaseline(cfg: DraftopsConfig, champion_version: str) -> list[str]:
    """Drop every replica's windows of `champion_version`, so that its baseline is made afresh from the next windows
    on (`draftops monitor rebaseline`); the replicas whose windows were dropped."""
    path = store_path(cfg)
    if not path.exists():
        return []
    with FileLock(str(path) + ".lock", timeout=LOCK_TIMEOUT):
        store = load_store(path)
        dropped = [name for name, state in store["replicas"].items()
                   if state["versions"].pop(champion_version, None) is not None]
        write_text_atomic(path, json.dumps(store, indent=1))
    return dropped


def record(state: dict, reading: dict, window: SpecCounters | None, restarted: bool, champion_version: str, at: str,
           n_baseline: int, n_recent: int) -> tuple[Window | None, list[str]]:
    """Add one scrape (`reading`, what is kept of it as `last`) and the window it closes to a replica's state: the
    window (or None) and notes saying why a window was not kept."""
    last = state["last"]
    state["last"] = {"at": at, "champion_version": champion_version, "reading": reading}
    version = state["versions"].setdefault(champion_version, {"baseline": [], "recent": []})
    notes = []
    if restarted:
        notes.append("counters went down since the last scrape (restart): the window is what it counted since")
    if last is None or window is None:
        notes.append("first reading of this replica: the next scrape closes its first window")
        return None, notes
    kept = Window(last["at"], at, champion_version, window, restarted)
    if last["champion_version"] != champion_version:
        version["recent"] = []
        notes.append(f"the window spans a change of champion ({last['champion_version']} -> {champion_version}): "
                     "not kept")
        return kept, notes
    if window.draft_tokens <= 0:
        notes.append("no draft tokens since the last scrape (idle): no window kept")
        return kept, notes
    if len(version["baseline"]) < n_baseline:
        version["baseline"].append(kept.to_dict())
    else:
        version["recent"] = (version["recent"] + [kept.to_dict()])[-n_recent:]
    return kept, notes


def windows_of(state: dict, champion_version: str) -> tuple[list[Window], list[Window]]:
    """(baseline, recent) windows a replica's state keeps for a version."""
    version = state["versions"].get(champion_version, {"baseline": [], "recent": []})
    return ([Window.from_dict(w) for w in version["baseline"]], [Window.from_dict(w) for w in version["recent"]])


def _source(endpoint: EngineEndpoint, core: str | None = None) -> dict:
    return {"url": endpoint.url, "model": endpoint.model, "kind": endpoint.kind, "core": core}


def read_endpoint(endpoint: EngineEndpoint, timeout: float, fetch: Fetch | None = None
                  ) -> dict[str, tuple[dict, SpecCounters | SglangGauges]]:
    """One scrape of one endpoint: {replica name: (its source, its reading)}, one per engine core with per_core;
    ServerMetricsError when it cannot be read."""
    text = (fetch or scrape)(endpoint.url, timeout)
    if endpoint.kind == "sglang" or (endpoint.kind == "auto" and is_sglang(text)):
        return {endpoint.name: (_source(endpoint), parse_sglang(text, endpoint.model))}
    cores = parse_per_core(text, endpoint.model, "auto" if endpoint.kind == "auto" else endpoint.kind)
    if endpoint.per_core and any(cores):
        return {f"{endpoint.name}/engine={core}": (_source(endpoint, core), counters)
                for core, counters in cores.items()}
    return {endpoint.name: (_source(endpoint), sum_counters(cores.values()))}


def _window(state: dict, reading: SpecCounters | SglangGauges) -> tuple[SpecCounters | None, bool]:
    last = state["last"]
    if last is None:
        return None, False
    return reading.window_since(reading_from_dict(last["reading"]))


def _unreachable(store: dict, endpoint: EngineEndpoint, error: str) -> dict[str, ReplicaWindows]:
    """An endpoint that could not be read: each of its known cores (with per_core), else the endpoint, unreachable."""
    cores = [n for n in store["replicas"] if endpoint.per_core and n.startswith(f"{endpoint.name}/engine=")]
    return {name: ReplicaWindows(name, endpoint.url, error=error) for name in cores or [endpoint.name]}


def scrape_fleet(cfg: DraftopsConfig, champion_version: str, fetch: Fetch | None = None
                 ) -> dict[str, ReplicaWindows]:
    """Scrape every configured replica once (in parallel), record the windows this closes, and return each replica's
    windows of `champion_version`."""
    m = cfg.monitor
    endpoints = m.replica_endpoints()
    with ThreadPoolExecutor(max_workers=min(16, len(endpoints))) as pool:
        futures = [(e, pool.submit(read_endpoint, e, m.server_timeout, fetch)) for e in endpoints]
        results = []
        for endpoint, future in futures:
            try:
                results.append((endpoint, future.result(), None))
            except ServerMetricsError as exc:
                results.append((endpoint, None, str(exc)))
    at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    out: dict[str, ReplicaWindows] = {}
    path = store_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock", timeout=LOCK_TIMEOUT):
        store = load_store(path)
        for endpoint, readings, error in results:
            if readings is None:
                out.update(_unreachable(store, endpoint, error))
                continue
            for name, (source, reading) in readings.items():
                state = replica_state(store, name, source)
                window, restarted = _window(state, reading)
                latest, notes = record(state, reading.to_dict(), window, restarted, champion_version, at,
                                       m.server_baseline_windows, m.server_recent_windows)
                baseline, recent = windows_of(state, champion_version)
                engine = reading.to_dict()["engine"]
                out[name] = ReplicaWindows(name, endpoint.url, engine, baseline, recent, latest, notes)
        store["scraped_at"] = time.time()
        write_text_atomic(path, json.dumps(store, indent=1))
    return out


def stored_fleet(cfg: DraftopsConfig, champion_version: str) -> dict[str, ReplicaWindows]:
    """Every configured replica's windows of `champion_version` as the store keeps them (no scrape)."""
    store = load_store(store_path(cfg))
    out = {}
    for endpoint in cfg.monitor.replica_endpoints():
        names = [n for n in store["replicas"] if endpoint.per_core and n.startswith(f"{endpoint.name}/engine=")]
        for name in names or [endpoint.name]:
            state = store["replicas"].get(name)
            if state is None:
                out[name] = ReplicaWindows(name, endpoint.url, notes=["not scraped yet"])
                continue
            baseline, recent = windows_of(state, champion_version)
            engine = (state["last"] or {}).get("reading", {}).get("engine")
            out[name] = ReplicaWindows(name, endpoint.url, engine, baseline, recent,
                                       (recent or baseline or [None])[-1])
    return out


def scrape_due(cfg: DraftopsConfig) -> bool:
    """Whether a check scrapes itself: no scrape job (interval 0), or the last scrape is older than its interval."""
    interval = cfg.monitor.scrape_interval_minutes * 60
    scraped_at = load_store(store_path(cfg)).get("scraped_at")
    return interval <= 0 or scraped_at is None or time.time() - scraped_at >= interval


def scrape_job(config_path: str | None) -> None:
    """The service's periodic scrape: every replica once, under the champion version of the moment. Never raises (a
    failed scrape is logged; the next one tries again)."""
    try:
        cfg = load_config(config_path)
        setup_mlflow(cfg)
        version = registry.champion(cfg.tracking.registered_model).version
        read = scrape_fleet(cfg, str(version))
        down = [name for name, r in read.items() if r.error]
        log.info("engines scraped (%d replicas%s)", len(read), f"; unreachable: {', '.join(down)}" if down else "")
    except Exception:
        log.warning("engine scrape failed", exc_info=True)


def recorded_windows(cfg: DraftopsConfig) -> list[tuple[float, float]]:
    """(accepted, draft tokens) of every counter window the store keeps, for `draftops monitor simulate --server`."""
    store = load_store(store_path(cfg))
    return [(w["counters"]["accepted"], w["counters"]["draft_tokens"]) for state in store["replicas"].values()
            for v in state["versions"].values() for w in v["baseline"] + v["recent"]
            if w["counters"]["engine"] != GAUGE_ENGINE]

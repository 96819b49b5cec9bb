"""What a monitor check reads, all of it before it measures: the champion and its stored figures (the registry), the
held-out traffic, the engine check due (deploy.json) and the engines' windows, the models.

Read once, up front, so that the check's later steps decide and act on what was read and never go back to the
registry or the engines for more."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from monitor.check import engine_acceptance
from monitor.check.engine_acceptance import EngineCheck
from monitor.check.prompt_acceptance import Baseline, Measurement
from monitor.fleet import verdicts
from monitor.fleet.load import EngineLoad, read_load
from monitor.fleet.verdicts import FleetReading
from pipeline import registry
from pipeline.config import DraftopsConfig
from pipeline.traffic import TrafficError, heldout_by_recency


class Timings(dict):
    """Seconds per named step; `with timings("name"):` adds the block's."""

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self[name] = self.get(name, 0.0) + time.perf_counter() - start


@dataclass
class Observed:
    """What one check read."""

    name: str  # the registered model
    champion: registry.RegisteredVersion
    heldout: list  # every held-out request, oldest first
    baseline: Baseline | None  # the champion's stored baseline
    break_even: float | None
    break_even_source: str
    server: FleetReading | None  # the replicas' windows and verdicts, when engines are configured
    load: tuple[dict[str, EngineLoad], str | None] | None  # their running requests, for the boundary watch
    engine: EngineCheck | None  # the engine check's windows, when one is due
    stored: dict[str, Measurement | None]  # the stored baselines of the other versions the engine check needs
    target: object
    draft: object
    timings: Timings = field(default_factory=Timings)

    @property
    def champion_version(self) -> str:
        return self.champion.version


def observe(cfg: DraftopsConfig, load: Callable, wait: Callable[[float], None]) -> Observed:
    """Read everything a check decides on (module docstring), with tracking set up. `load(cfg, uri)` gives (target,
    draft); `wait(s)` lets the engine check's windows pass."""
    name, timings = cfg.tracking.registered_model, Timings()
    engine = engine_acceptance.due(cfg)
    champion = registry.champion(name)
    champion_uri = registry.version_uri(name, champion.version)
    stored = registry.load_baseline(champion)
    break_even, break_even_source = registry.break_even(champion, cfg.monitor.break_even_alpha)
    others = {} if engine is None else {
        v: registry.stored_baseline(name, v) for v in (engine.version, engine.previous_version)
        if v and v != champion.version}
    heldout = heldout_by_recency(cfg.traffic)
    if not heldout:
        raise TrafficError(f"{cfg.traffic.path}: the held-out split is empty at traffic.heldout_fraction="
                           f"{cfg.traffic.heldout_fraction}; the check measures held-out requests only")
    server, load_reading = None, None
    if verdicts.configured(cfg):
        with timings("server_metrics"):
            server = verdicts.read_fleet(cfg, champion.version)
            if cfg.monitor.engine_boundary:
                load_reading = read_load(cfg, time.time())
    if engine is not None:
        engine.version = engine.version or champion.version
        with timings("engine_windows"):
            engine_acceptance.read_windows(cfg, engine, wait)
    with timings("load_models"):
        target, draft = load(cfg, champion_uri)
    return Observed(name, champion, heldout, None if stored is None else Baseline.from_dict(stored), break_even,
                    break_even_source, server, load_reading, engine,
                    {v: None if s is None else Baseline.from_dict(s).measurement for v, s in others.items()},
                    target, draft, timings)

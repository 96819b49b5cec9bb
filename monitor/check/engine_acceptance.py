"""The engine check: does the serving engine get the acceptance the draft it should run measured offline?

The check reads the speculative-decoding counters of every replica with a URL (`monitor.engines`, or its shorthand
`monitor.server_metrics_url`) `check_windows` times over windows of `check_window_seconds` (a window with fewer than
`min_window_draft_tokens` draft tokens over the fleet is extended, up to three times its length), then compares the
engine's acceptance over those windows with the offline figure of the version the engine should serve: its baseline's
per-prompt accepted and drafted tokens as an engine counts them at decode.gamma (`monitor.fleet.offline_expectation`),
by `engine_vs_offline_test` at monitor.level, tolerating a shortfall of `monitor.deploy.mismatch_tolerance` of the
offline figure. With several replicas, each replica's windows and the fleet's summed windows are each compared, at
monitor.level / (replicas + 1) (Bonferroni): one replica left on the old draft is named."""
# When it runs (`monitor.deploy.engine_check`): `after_deploy`, the first check after a deploy (deploy.json says the
# check is pending): the post-deploy check. Clearly below -> DEPLOY_MISMATCH (the engine does not run the measured
# draft); the engine is also compared with the previous version's offline figure (its baseline, recorded before the
# drift that replaced it): not clearly below it means the deploy recovered the acceptance. `always`: every check; a
# shortfall outside a post-deploy check is the server's evidence of a drop (`monitor.check.decision`, like the window
# tests of `monitor.fleet.verdicts`, which need many more windows to decide).
#
# The offline figure assumes the engine drafts decode.gamma tokens a round from the draft alone and decodes greedily
# (temperature 0) up to decode.max_new_tokens, as the demo's traffic does (llama-server --spec-draft-n-max γ
# --spec-draft-p-min 0; vLLM num_speculative_tokens γ). An engine that drafts fewer tokens where the draft is unsure
# (llama-server's default --spec-draft-p-min 0.75) counts a higher acceptance, never a lower one: the check stays
# one-sided and valid, only less sensitive.
#
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from monitor.check.decision import Decision, Status
from monitor.check.prompt_acceptance import Measurement
from monitor.fleet.counters import ImpossibleCounters, ServerMetricsError, SpecCounters, sum_counters
from monitor.fleet.offline_expectation import engine_vs_offline_test
from monitor.fleet.sglang import SglangGauges
from monitor.fleet.window_store import read_endpoint
from monitor.release.layout import PENDING, DeployFolder
from monitor.stats.acceptance_tests import DropTest
from pipeline.config import DraftopsConfig

EXTENSIONS = 3  # a window with too few draft tokens is read again this many times at most


@dataclass
class EngineCheck:
    """The engine's windows, and how they compare with the offline figures."""

    url: str
    version: str  # the version the engine should serve
    post_deploy: bool
    windows: list[SpecCounters] = field(default_factory=list)  # summed over the replicas' counter windows
    replica_windows: dict[str, list[SpecCounters]] = field(default_factory=dict)
    replica_tests: dict[str, DropTest] = field(default_factory=dict)  # with several replicas: each against the figure
    seconds: float = 0.0
    expected: float | None = None  # the version's offline acceptance, as an engine counts it
    test: DropTest | None = None  # engine vs that figure
    previous_version: str | None = None
    pre_drift: DropTest | None = None  # engine vs the previous version's offline figure (post-deploy)
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    impossible: bool = False  # the error: counters that cannot be true (an ERROR, never a confirmation)
    endpoints: list = field(default_factory=list, repr=False)  # the replicas read (monitor.config.Endpoint)

    @property
    def acceptance(self) -> float | None:
        tokens = sum(w.draft_tokens for w in self.windows)
        return sum(w.accepted for w in self.windows) / tokens if tokens > 0 else None

    @property
    def mismatched(self) -> list[str]:
        """The replicas clearly below the offline figure."""
        return [name for name, test in self.replica_tests.items() if test.alarm]

    @property
    def mismatch(self) -> bool:
        return self.post_deploy and ((self.test is not None and self.test.alarm) or bool(self.mismatched))

    @property
    def recovered(self) -> bool | None:
        return None if self.pre_drift is None else not self.pre_drift.alarm

    def to_dict(self) -> dict:
        return {"url": self.url, "version": self.version, "post_deploy": self.post_deploy,
                "windows": [w.to_dict() for w in self.windows], "seconds": self.seconds,
                "replica_windows": {k: [w.to_dict() for w in ws] for k, ws in self.replica_windows.items()},
                "replica_tests": {k: t.to_dict() for k, t in self.replica_tests.items()},
                "mismatched": self.mismatched,
                "acceptance": self.acceptance, "expected": self.expected, "test": self.test and self.test.to_dict(),
                "previous_version": self.previous_version, "pre_drift": self.pre_drift and self.pre_drift.to_dict(),
                "mismatch": self.mismatch, "recovered": self.recovered, "notes": self.notes, "error": self.error}

    def summary(self) -> str:
        kind = "post-deploy check" if self.post_deploy else "engine check"
        if self.error:
            return f"  {kind}: {self.error}"
        per_window = ", ".join(f"{w.acceptance:.3f}" for w in self.windows)
        lines = [f"  {kind} (version {self.version}): engine acceptance "
                 + (f"{self.acceptance:.3f} over {len(self.windows)} windows ({per_window})" if self.windows
                    else "not read")]
        for name, test in ((f"version {self.version} offline", self.test),
                           (f"the previous deployment (version {self.previous_version}) offline", self.pre_drift)):
            if test is not None:
                lines.append(f"    vs {name} {test.baseline_acceptance:.3f}: drop {test.drop:+.3f} "
                             f"[{test.ci_low:+.3f}, {test.ci_high:+.3f}], p={test.p_value:.3g}"
                             f"{' -> clearly below' if test.alarm else ''}")
        for name, test in self.replica_tests.items():
            lines.append(f"    replica {name}: {test.current_acceptance:.3f} vs offline "
                         f"{test.baseline_acceptance:.3f}, p={test.p_value:.3g}"
                         f"{' -> clearly below' if test.alarm else ''}")
        if self.post_deploy and (self.test is not None or self.replica_tests):
            lines.append("    deployed draft " + ("NOT what the engine runs: DEPLOY_MISMATCH" if self.mismatch
                                                  else "confirmed in the engine")
                         + ("" if self.recovered is None else
                            f"; acceptance {'recovered' if self.recovered else 'not recovered'} to the previous "
                            "deployment's figure (after a drift: the pre-drift one)"))
        return "\n".join(lines)


def due(cfg: DraftopsConfig) -> EngineCheck | None:
    """The engine check this check runs (not yet read), or None: none configured, or none due. Its `version` is the
    one deploy.json names; empty when none does (the champion's, filled in by the caller)."""
    m, d = cfg.monitor, cfg.monitor.deploy
    endpoints = [e for e in m.replica_endpoints() if e.url]
    if not endpoints or d.engine_check == "off":
        return None
    state = DeployFolder.of(cfg).read_state() if d.enabled else {}
    pending = bool(state) and state.get("check") == PENDING and bool(state.get("reloaded"))
    if not pending and d.engine_check != "always":
        return None
    return EngineCheck(", ".join(e.url for e in endpoints), str(state.get("version") or ""), pending,
                       previous_version=state.get("previous_version") if pending else None, endpoints=endpoints)


def _read_all(endpoints: list, timeout: float, fetch: Callable[[str, float], str] | None
              ) -> dict[str, SpecCounters | SglangGauges]:
    """One scrape of every replica in `endpoints`: {replica: its reading}; ServerMetricsError when none can be read."""
    readings, errors = {}, []
    for endpoint in endpoints:
        try:
            readings.update({name: reading for name, (_, reading) in
                             read_endpoint(endpoint, timeout, fetch).items()})
        except ImpossibleCounters:  # an engine that cannot be right is an ERROR, whatever the others read
            raise
        except ServerMetricsError as exc:
            errors.append(f"{endpoint.name}: {exc}" if len(endpoints) > 1 else str(exc))
    if not readings:
        raise ServerMetricsError("; ".join(errors))
    return readings


def _windows(before: dict, now: dict) -> tuple[dict[str, SpecCounters], bool]:
    """Each replica's window between two readings of the fleet, and whether any restarted."""
    out, restarted = {}, False
    for name, reading in now.items():
        window, again = reading.window_since(before.get(name))
        if window is not None:
            out[name] = window
        restarted |= again
    return out, restarted


def read_windows(cfg: DraftopsConfig, check: EngineCheck, wait: Callable[[float], None] = time.sleep,
                 fetch: Callable[[str, float], str] | None = None) -> EngineCheck:
    """Scrape every replica once, then once after each window (module docstring); `wait(seconds)` lets time (and
    traffic) pass. `windows` sums the replicas' counter windows; `replica_windows` keeps each replica's."""
    d, timeout = cfg.monitor.deploy, cfg.monitor.server_timeout
    endpoints = check.endpoints or [e for e in cfg.monitor.replica_endpoints() if e.url]
    start = time.perf_counter()
    try:
        before = _read_all(endpoints, timeout, fetch)
        for _ in range(d.check_windows):
            for _ in range(EXTENSIONS):
                wait(d.check_window_seconds)
                now = _read_all(endpoints, timeout, fetch)
                windows, restarted = _windows(before, now)
                counted = [w for w in windows.values() if not w.gauge]
                if not counted or sum(w.draft_tokens for w in counted) >= d.min_window_draft_tokens:
                    break
            if restarted:
                check.notes.append("an engine restarted during a window: the window is what it counted since")
            for name, window in windows.items():
                if window.draft_tokens > 0:
                    check.replica_windows.setdefault(name, []).append(window)
            counted = [w for w in windows.values() if not w.gauge and w.draft_tokens > 0]
            if counted:
                check.windows.append(sum_counters(counted))
            else:
                check.notes.append("a window without draft tokens (no traffic): not used")
            before = now
    except ServerMetricsError as exc:
        check.error, check.impossible = str(exc), isinstance(exc, ImpossibleCounters)
    check.seconds = time.perf_counter() - start
    return check


def _against(offline: Measurement | None, windows: list[SpecCounters], tolerance: float, level: float
             ) -> DropTest | None:
    values = offline.engine_values if offline is not None else None
    if values is None or len(values) < 2 or len(windows) < 2:
        return None
    return engine_vs_offline_test(values.acc, values.n, [w.accepted for w in windows],
                                  [w.draft_tokens for w in windows], tolerance, level)


def compare(check: EngineCheck, own: Measurement | None, previous: Measurement | None, tolerance: float,
            level: float) -> EngineCheck:
    """Test the windows against `own`, the offline figure of the version the engine should serve, and, after a
    deploy, against `previous`, the previous version's (each a baseline's measurement, or None when it has none)."""
    if check.error:
        return check
    # several replicas: each one, and their sum, against the figure at level / (replicas + 1) (Bonferroni)
    each = len(check.replica_windows) > 1 or not check.windows
    tested_at = level / (len(check.replica_windows) + bool(check.windows)) if each else level
    check.test = _against(own, check.windows, tolerance, tested_at)
    if each:
        check.replica_tests = {name: test for name, windows in check.replica_windows.items()
                               for test in [_against(own, windows, tolerance, tested_at)] if test is not None}
    if own is not None and own.engine_values is not None:
        check.expected = own.engine_values.acceptance
    if check.test is None and not check.replica_tests:
        why = ("fewer than 2 windows with draft tokens" if len(check.windows) < 2 else
               f"version {check.version} has no offline figure as an engine counts it (no baseline, or one recorded "
               "before draftops measured it)")
        check.notes.append(f"engine not compared: {why}")
        if check.post_deploy:
            check.notes.append("the post-deploy check stays pending: the next check tries again")
    if check.post_deploy and check.previous_version:
        check.pre_drift = _against(previous, check.windows, tolerance, level)
    return check


def with_engine(decision: Decision, engine: EngineCheck | None) -> Decision:
    """The check's decision once the engine check is in: ERROR when its counters cannot be true, DEPLOY_MISMATCH when
    the post-deploy check found the engine clearly below the deployed draft's offline figure (an ERROR stays an
    ERROR); the engine check's notes added."""
    if engine is None:
        return decision
    notes = decision.notes + [f"engine check: {n}" for n in ([f"not read: {engine.error}"] if engine.error
                                                              else engine.notes)]
    if engine.impossible:
        return Decision(Status.ERROR, None, decision.reasons + [f"engine check: {engine.error}"], notes)
    if not engine.mismatch or decision.status is Status.ERROR:
        return Decision(decision.status, decision.cause, decision.reasons, notes)
    t = engine.test if engine.test is not None and engine.test.alarm else engine.replica_tests[engine.mismatched[0]]
    which = f" (replica {', '.join(engine.mismatched)})" if engine.mismatched else ""
    reason = (f"post-deploy check: the engine's acceptance{which} {t.current_acceptance:.3f} over "
              f"{t.n_current_prompts} windows is clearly below version {engine.version}'s offline "
              f"{t.baseline_acceptance:.3f} (drop {t.drop:.3f} > margin {t.margin:.3f}, p={t.p_value:.2g}): the engine "
              "does not run the deployed draft (a wrong or stale file, a misaligned vocabulary, an engine not "
              "reloaded)")
    return Decision(Status.DEPLOY_MISMATCH, None, [reason], [f"also: {r}" for r in decision.reasons] + notes)

"""The serving fleet: every replica's windows, its own verdict, the fleet's aggregate, and the replica that parts from
the others.

Where windows come from: Prometheus' API when `monitor.prometheus_url` is set (monitor.fleet.prometheus), else the
monitor's own window store (monitor.fleet.window_store: a check scrapes when the service's periodic scrape has not).

Tests, all at the check's level split evenly (Bonferroni) over the family: each replica whose baseline and recent
windows are complete gets the window test of its recent windows against its own baseline (`window_drop_test`, the
window the unit), and with two or more such replicas the fleet's summed windows (same window ends) get one too; with R
replicas tested the family has R + 1 tests, each at level / (R + 1), so that the fleet's false-alarm rate stays at the
level (one replica: the level itself). The permutation test's smallest p is 1 / C(b + r, r): a note says when the
windows are too few to ever alarm at level / (R + 1)."""
# Verdicts: a replica is `unreachable` (not read; with Prometheus also when its `up` is 0), DRIFT (its window test
# alarms), `idle` (no draft tokens in its latest window), OK (its test ran and did not alarm), or `collecting` (too few
# windows yet); the post-deploy engine check can make it DEPLOY_MISMATCH (monitor.check.decision.with_fleet). The fleet:
# ERROR when no replica could be read (one down is a note), else the worst of DEPLOY_MISMATCH, DRIFT (a replica or the
# summed windows), OK, idle, collecting. A replica unreachable at `monitor.replica_down_checks` checks in a row is down
# (`down`; the run of checks is kept in `<monitor.state_dir>/replicas_down.json`, across processes and restarts): the
# check pages for it (DraftReplicaDown) and its decision is REPLICA_DOWN where it would have been OK. A check that could
# not read Prometheus at all counts no replica either way.
#
# The replica that parts from the others (`outlier_tests`): a two-proportion test of its accepted / drafted tokens over
# the recent windows against the pooled other replicas', z = (p_i - p_rest) / sqrt(phi p (1 - p) (1/N_i + 1/N_rest)),
# two-sided, with a quasi-binomial overdispersion phi >= 1 estimated from the windows themselves (the Pearson
# chi-square of every replica's baseline and recent windows around their own mean, over its degrees of freedom df) and
# p from Student's t with df: tokens of one window share requests and are not independent trials, and phi widens the
# test by as much as they are not. Bonferroni over the R replicas compared: a replica is named when p < level / R, step
# by step: the most significant one is named and left out, and the others are compared again among themselves (else one
# replica far below would pull the rest's mean down and make the others look high). With two replicas left the two
# comparisons are one, and only the lower one can be named. Windows of one time share the traffic's hour, which phi
# counts as noise too: the test is conservative. SGLang's gauge windows (weight 1) make it a test of mean window
# acceptance rates.
#
from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from scipy import stats as sps

from monitor.fleet.counters import SpecCounters, sum_counters
from monitor.fleet.prometheus import PrometheusError, api_get, fleet_windows
from monitor.fleet.window_store import ReplicaWindows, Window, scrape_due, scrape_fleet, stored_fleet
from monitor.stats.acceptance_tests import DropTest, window_drop_test
from pipeline.config import DraftopsConfig
from pipeline.files import write_text_atomic

OK, DRIFT, IDLE, UNREACHABLE, COLLECTING = "OK", "DRIFT", "idle", "unreachable", "collecting"
DEPLOY_MISMATCH, ERROR = "DEPLOY_MISMATCH", "ERROR"
DOWN_FILE = "replicas_down.json"
OUTLIER_METHOD = "two-proportion t (quasi-binomial overdispersion from windows), Bonferroni over replicas"


@dataclass(frozen=True)
class OutlierTest:
    """One replica's recent acceptance against the pooled other replicas' (module docstring)."""

    replica: str
    acceptance: float
    rest_acceptance: float
    statistic: float
    p_value: float
    level: float  # level / replicas compared
    dispersion: float
    df: int
    named: bool
    method: str = OUTLIER_METHOD

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ReplicaReading:
    """One replica's windows, its window test and verdict."""

    name: str
    url: str | None
    engine: str | None
    verdict: str = COLLECTING
    latest: Window | None = None
    test: DropTest | None = None
    n_baseline_windows: int = 0
    n_recent_windows: int = 0
    outlier: OutlierTest | None = None
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    down_checks: int = 0  # checks in a row, this one included, that found it unreachable

    def to_dict(self) -> dict:
        return {"name": self.name, "url": self.url, "engine": self.engine, "verdict": self.verdict,
                "down_checks": self.down_checks,
                "window": self.latest and self.latest.to_dict(),
                "acceptance": self.latest.counters.acceptance if self.latest else None,
                "test": self.test and self.test.to_dict(), "n_baseline_windows": self.n_baseline_windows,
                "n_recent_windows": self.n_recent_windows, "outlier": self.outlier and self.outlier.to_dict(),
                "notes": self.notes, "error": self.error}

    def summary(self) -> str:
        head = f"  replica {self.name}{f' ({self.engine})' if self.engine else ''}: {self.verdict}"
        if self.error:
            return f"{head}: {self.error}"
        parts = [head]
        if self.latest is not None and self.latest.counters.draft_tokens > 0:
            c = self.latest.counters
            size = "gauge" if c.gauge else f"{c.accepted:.0f}/{c.draft_tokens:.0f} draft tokens"
            positions = ", ".join(f"{a:.3f}" for a in c.position_acceptance())
            by_position = f"; by position {positions}" if positions else ""
            parts.append(f"window acceptance {c.acceptance:.3f} ({size}{by_position})")
        if self.test is not None:
            t = self.test
            parts.append(f"windows {t.baseline_acceptance:.3f} -> {t.current_acceptance:.3f}, drop {t.drop:+.3f} "
                         f"[{t.ci_low:+.3f}, {t.ci_high:+.3f}], p={t.p_value:.3g} ({t.n_current_prompts} recent vs "
                         f"{t.n_baseline_prompts} baseline)")
        else:
            parts.append(f"{self.n_baseline_windows} baseline and {self.n_recent_windows} recent windows")
        if self.outlier is not None and self.outlier.named:
            o = self.outlier
            parts.append(f"PARTS FROM THE OTHERS: {o.acceptance:.3f} vs {o.rest_acceptance:.3f}, p={o.p_value:.2g}")
        return "; ".join(parts)


@dataclass
class FleetReading:
    """What one check read from the fleet: each replica's reading, the summed windows' test, the aggregate verdict."""

    source: str  # "prometheus", "scrape" (this check scraped) or "store" (the service's scrapes)
    replicas: list[ReplicaReading] = field(default_factory=list)
    pooled: DropTest | None = None  # the fleet's summed windows, with two or more replicas tested
    latest: Window | None = None  # the fleet's latest window, summed over replicas
    notes: list[str] = field(default_factory=list)
    error: str | None = None  # no replica could be read
    down: list[str] = field(default_factory=list)  # unreachable at monitor.replica_down_checks checks in a row
    windows: dict[str, ReplicaWindows] = field(default_factory=dict, repr=False)  # what the verdicts were made from

    @property
    def test(self) -> DropTest | None:
        """The test the decision reads: the most significant drifting replica's, else the summed windows', else the
        one replica's."""
        drifting = [r.test for r in self.replicas if r.verdict == DRIFT and r.test is not None]
        if drifting:
            return min(drifting, key=lambda t: t.p_value)
        if self.pooled is not None:
            return self.pooled
        tested = [r.test for r in self.replicas if r.test is not None]
        return tested[0] if len(tested) == 1 else None

    @property
    def window(self) -> Window | None:
        return self.latest

    def named(self, verdict: str) -> list[str]:
        return [r.name for r in self.replicas if r.verdict == verdict]

    def outliers(self) -> list[OutlierTest]:
        return [r.outlier for r in self.replicas if r.outlier is not None and r.outlier.named]

    @property
    def verdict(self) -> str:
        if self.error or (self.replicas and all(r.verdict == UNREACHABLE for r in self.replicas)):
            return ERROR
        verdicts = {r.verdict for r in self.replicas}
        if self.pooled is not None and self.pooled.alarm:
            verdicts.add(DRIFT)
        for verdict in (DEPLOY_MISMATCH, DRIFT, OK, IDLE):
            if verdict in verdicts:
                return verdict
        return COLLECTING

    def to_dict(self) -> dict:
        return {"source": self.source, "verdict": self.verdict, "window": self.latest and self.latest.to_dict(),
                "acceptance": self.latest.counters.acceptance if self.latest else None,
                "test": self.test and self.test.to_dict(), "pooled": self.pooled and self.pooled.to_dict(),
                "replicas": [r.to_dict() for r in self.replicas], "notes": self.notes, "error": self.error,
                "down": self.down}

    def summary(self) -> str:
        if self.verdict == ERROR:  # why is the decision's reason (monitor.check.decision.with_fleet): said once
            return f"  engines ({self.source}): none read"
        lines = [f"  engines ({self.source}): {self.verdict}, {len(self.replicas)} replica(s)"]
        if self.pooled is not None:
            t = self.pooled
            lines[0] += (f"; fleet windows {t.baseline_acceptance:.3f} -> {t.current_acceptance:.3f}, drop "
                         f"{t.drop:+.3f}, p={t.p_value:.3g}")
        return "\n".join(lines + [r.summary() for r in self.replicas])


def fleet_verdict(reading: FleetReading | None) -> tuple[str | None, dict[str, str]]:
    """(the fleet's verdict, {replica name: its verdict}): what an alert names; (None, {}) without engines."""
    if reading is None:
        return None, {}
    return reading.verdict, {r.name: r.verdict for r in reading.replicas}


def _sum_by_end(windows: list[Window]) -> list[tuple[float, float]]:
    by_end: dict[str, list[float]] = {}
    for w in windows:
        acc_n = by_end.setdefault(w.end, [0.0, 0.0])
        acc_n[0] += w.counters.accepted
        acc_n[1] += w.counters.draft_tokens
    return [tuple(v) for _, v in sorted(by_end.items())]


def _drop_test(baseline: list[tuple[float, float]], recent: list[tuple[float, float]], cfg: DraftopsConfig,
               level: float) -> DropTest:
    m = cfg.monitor
    return window_drop_test([a for a, _ in baseline], [n for _, n in baseline], [a for a, _ in recent],
                            [n for _, n in recent], m.margin, level, seed=cfg.seed)


def _pearson(windows: list[SpecCounters]) -> tuple[float, int]:
    """(Pearson chi-square of windows around their pooled ratio, degrees of freedom)."""
    acc, n = sum(w.accepted for w in windows), sum(w.draft_tokens for w in windows)
    p = acc / n if n > 0 else math.nan
    if len(windows) < 2 or not 0.0 < p < 1.0:
        return 0.0, 0
    return sum((w.accepted - p * w.draft_tokens) ** 2 / (p * (1 - p) * w.draft_tokens) for w in windows
               if w.draft_tokens > 0), len(windows) - 1


def outlier_tests(windows: dict[str, ReplicaWindows], level: float) -> dict[str, OutlierTest]:
    """Each replica's recent acceptance against the pooled others' (module docstring); empty with fewer than two
    replicas with recent windows, or no degrees of freedom to estimate the overdispersion from."""
    recent = {name: [w.counters for w in r.recent] for name, r in windows.items() if r.recent and not r.error}
    kinds = {name: ws[0].gauge for name, ws in recent.items()}
    majority = sum(kinds.values()) * 2 > len(kinds)
    recent = {name: ws for name, ws in recent.items() if kinds[name] == majority}
    if len(recent) < 2:
        return {}
    chi2 = df = 0
    for name in recent:
        for group in (windows[name].baseline, windows[name].recent):
            x, d = _pearson([w.counters for w in group])
            chi2, df = chi2 + x, df + d
    if df == 0:
        return {}
    phi = max(1.0, chi2 / df)
    totals = {name: (sum(w.accepted for w in ws), sum(w.draft_tokens for w in ws)) for name, ws in recent.items()}
    per_test = level / len(recent)
    out: dict[str, OutlierTest] = {}
    while len(totals) >= 2:  # step by step: the most significant replica named, then the rest compared again
        tests = {name: _against_rest(name, totals, phi, df, per_test) for name in totals}
        if len(tests) == 2:  # one comparison: only the lower replica can be named
            high = max(tests.values(), key=lambda o: o.acceptance)
            tests[high.replica] = OutlierTest(**{**asdict(high), "named": False})
        for name, test in tests.items():
            out.setdefault(name, test)
        first = min(tests.values(), key=lambda o: o.p_value)
        if not first.named:
            break
        out[first.replica] = first
        del totals[first.replica]
        for name in totals if len(totals) >= 2 else ():
            out.pop(name)
    return out


def _against_rest(name: str, totals: dict[str, tuple[float, float]], phi: float, df: int, level: float
                  ) -> OutlierTest:
    """One replica's recent (accepted, drafted) against the sum of the others' in `totals`."""
    acc, n = totals[name]
    rest_acc, rest_n = sum(a for k, (a, _) in totals.items() if k != name), \
        sum(m for k, (_, m) in totals.items() if k != name)
    pooled = (acc + rest_acc) / (n + rest_n)
    se = math.sqrt(phi * pooled * (1 - pooled) * (1 / n + 1 / rest_n)) if 0 < pooled < 1 else math.nan
    statistic = (acc / n - rest_acc / rest_n) / se if se > 0 else 0.0
    p_value = float(2 * sps.t.sf(abs(statistic), df)) if math.isfinite(statistic) else 1.0
    return OutlierTest(name, acc / n, rest_acc / rest_n, statistic, p_value, level, phi, df, p_value < level)


def _replica(r: ReplicaWindows, cfg: DraftopsConfig, level: float | None) -> ReplicaReading:
    """One replica's reading; its window test at `level` when its windows are complete (None: not tested)."""
    m = cfg.monitor
    reading = ReplicaReading(r.name, r.url, r.engine, latest=r.latest, n_baseline_windows=len(r.baseline),
                             n_recent_windows=len(r.recent), notes=list(r.notes), error=r.error)
    if r.error:
        reading.verdict = UNREACHABLE
        return reading
    if level is not None:
        reading.test = _drop_test([(w.counters.accepted, w.counters.draft_tokens) for w in r.baseline],
                                  [(w.counters.accepted, w.counters.draft_tokens) for w in r.recent], cfg, level)
    else:
        reading.notes.append(f"{len(r.baseline)} of {m.server_baseline_windows} baseline and {len(r.recent)} of "
                             f"{m.server_recent_windows} recent windows; the window test runs once both are complete")
    idle = r.latest is not None and r.latest.counters.draft_tokens <= 0
    if reading.test is not None and reading.test.alarm:
        reading.verdict = DRIFT
    elif idle:
        reading.verdict = IDLE
    elif reading.test is not None:
        reading.verdict = OK
    return reading


def evaluate(windows: dict[str, ReplicaWindows], cfg: DraftopsConfig, source: str) -> FleetReading:
    """Verdicts, tests and the aggregate from every replica's windows (module docstring)."""
    m = cfg.monitor
    complete = [n for n, r in windows.items() if not r.error and len(r.baseline) >= m.server_baseline_windows
                and len(r.recent) >= m.server_recent_windows]
    counted = [n for n in complete if not windows[n].recent[0].counters.gauge] or complete
    family = len(complete) + (len(counted) > 1)
    level = m.level / max(family, 1)
    fleet = FleetReading(source, windows=windows)
    fleet.replicas = [_replica(r, cfg, level if name in complete else None) for name, r in windows.items()]
    if len(counted) > 1:
        baseline = _sum_by_end([w for n in counted for w in windows[n].baseline])
        recent = _sum_by_end([w for n in counted for w in windows[n].recent])
        if min(len(baseline), len(recent)) >= 2:
            fleet.pooled = _drop_test(baseline, recent, cfg, level)
    b, r = m.server_baseline_windows, m.server_recent_windows
    if complete and 1 / math.comb(b + r, r) >= level:
        fleet.notes.append(f"{b} baseline and {r} recent windows can never reach p < {level:.3g} (level / {family} "
                           "tests): raise monitor.server_baseline_windows")
    for name, outlier in outlier_tests(windows, m.level).items():
        next(r for r in fleet.replicas if r.name == name).outlier = outlier
    latest = [r.latest for r in windows.values() if r.latest is not None and not r.latest.counters.gauge]
    if latest:
        fleet.latest = Window(min(w.start for w in latest), max(w.end for w in latest), latest[0].champion_version,
                              sum_counters(w.counters for w in latest))
    return fleet


def configured(cfg: DraftopsConfig) -> bool:
    """Whether the check reads engines at all."""
    return bool(cfg.monitor.replica_endpoints() or cfg.monitor.prometheus_url)


def read_fleet(cfg: DraftopsConfig, champion_version: str, fetch: Callable[[str, float], str] | None = None,
               get: Callable[[str, float], dict] = api_get, now: float | None = None) -> FleetReading:
    """One check's reading of the fleet: its windows from Prometheus or from the window store (scraped now when the
    service has not), each replica's verdict, the aggregate."""
    m = cfg.monitor
    if m.prometheus_url:
        try:
            windows, source = fleet_windows(cfg, champion_version, get, now), "prometheus"
        except PrometheusError as exc:
            return FleetReading("prometheus", error=str(exc))
    elif scrape_due(cfg):
        windows, source = scrape_fleet(cfg, champion_version, fetch), "scrape"
    else:
        windows, source = stored_fleet(cfg, champion_version), "store"
    if not windows:
        return FleetReading(source, error="no replica found (monitor.engines lists none, and Prometheus holds no "
                                          "speculative-decoding series)")
    return count_down(evaluate(windows, cfg, source), cfg)


def count_down(fleet: FleetReading, cfg: DraftopsConfig) -> FleetReading:
    """Each replica's run of unreachable checks, kept on disk; `fleet.down` those at `monitor.replica_down_checks`
    or more (module docstring)."""
    path = Path(cfg.monitor.state_dir).resolve() / DOWN_FILE
    try:
        runs = json.loads(path.read_text())
    except (OSError, ValueError):
        runs = {}
    runs = {r.name: runs.get(r.name, 0) + 1 for r in fleet.replicas if r.verdict == UNREACHABLE}
    for replica in fleet.replicas:
        replica.down_checks = runs.get(replica.name, 0)
    fleet.down = [name for name, n in runs.items() if n >= cfg.monitor.replica_down_checks]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(runs, indent=1))
    return fleet

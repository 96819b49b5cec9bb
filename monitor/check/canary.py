"""The canary's judgement in a monitor check (`monitor.deploy.canary`): the canary replicas' windows against every
other replica's, and the verdict that rolls the new champion out or back (monitor.check.deploy_hooks.CanaryDeploys
acts on it; monitor.release.canary holds the steps and their state).

Each check judges from the windows it read (monitor.fleet.verdicts): every replica's windows of the new champion that
started after the canary was deployed, the last `canary.windows` of each. The canary replicas' windows (summed, when
several) are compared with each other replica's by the fleet's replica-parting test (`outlier_tests`: two-proportion
t with the windows' own overdispersion, Bonferroni over the replicas); the canary fails when it is named and lower.
Where the engines report tokens per second (monitor.fleet.load), it also fails when its mean is below
(1 - `speed_tolerance`) of the others'. Until every canary replica and one other have the windows, it is collecting.
The test's power at the configured windows (monitor.check.canary_power) is in every judgement and its MLflow run.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime

from monitor.check.canary_power import CANARY, canary_power, requests_per_window
from monitor.fleet.counters import sum_counters
from monitor.fleet.load import EngineLoad
from monitor.fleet.verdicts import FleetReading, outlier_tests
from monitor.fleet.window_store import ReplicaWindows, Window
from pipeline.config import DraftopsConfig

COLLECTING, PASS, FAIL = "collecting", "pass", "fail"
POWER_DROPS = (0.0, 0.05, 0.10)


@dataclass
class CanaryJudgement:
    """One check's judgement of the canary: its figures against the other replicas', and the verdict."""

    version: str
    previous: str | None
    canary: list[str]
    others: list[str]
    windows: int
    verdict: str = COLLECTING
    acceptance: float | None = None
    rest_acceptance: float | None = None
    p_value: float | None = None
    level: float | None = None
    tokens_per_second: float | None = None
    rest_tokens_per_second: float | None = None
    power: dict[float, float] = field(default_factory=dict)  # drop -> share of canaries failed (0: false failures)
    reasons: list[str] = field(default_factory=list)

    def figures(self) -> dict:
        numbers = {k: v for k, v in asdict(self).items() if isinstance(v, float)}
        return {**numbers, **{f"power_{100 * d:g}_points": p for d, p in self.power.items()}}

    def to_dict(self) -> dict:
        return {**asdict(self), "power": {str(k): v for k, v in self.power.items()}}

    def summary(self) -> str:
        who = f"canary {', '.join(self.canary)} (version {self.version})"
        if self.acceptance is None:
            return f"  {who}: {self.verdict}: " + "; ".join(self.reasons)
        line = (f"  {who}: {self.verdict.upper()}: acceptance {self.acceptance:.3f} vs {self.rest_acceptance:.3f} on "
                f"{', '.join(self.others)} over {self.windows} windows, p={self.p_value:.3g} (level {self.level:.3g})")
        if self.tokens_per_second is not None and self.rest_tokens_per_second is not None:
            line += f"; tokens/s {self.tokens_per_second:.1f} vs {self.rest_tokens_per_second:.1f}"
        if self.power:
            line += "; power " + ", ".join(f"{p:.2f} at {100 * d:g} points" for d, p in self.power.items() if d)
            line += f", false failures {self.power.get(0.0, 0.0):.3f}"
        return "\n".join([line] + [f"    {r}" for r in self.reasons])


def _since(reading: ReplicaWindows, t0: datetime, n: int) -> list[Window]:
    """The replica's last `n` windows (of the new champion) that started once the canary was deployed."""
    return [w for w in reading.baseline + reading.recent
            if w.counters.draft_tokens > 0 and datetime.fromisoformat(w.start) >= t0][-n:]


def _merged(windows: list[list[Window]]) -> list[Window]:
    """Several canary replicas' windows, position by position, as one replica's."""
    return [Window(ws[0].start, ws[-1].end, ws[0].champion_version, sum_counters(w.counters for w in ws))
            for ws in zip(*windows)]


def _speed(judgement: CanaryJudgement, load: dict[str, EngineLoad], tolerance: float) -> None:
    canary = [load[n].tokens_per_second for n in judgement.canary if n in load and load[n].tokens_per_second]
    rest = [load[n].tokens_per_second for n in judgement.others if n in load and load[n].tokens_per_second]
    if canary and rest:
        judgement.tokens_per_second, judgement.rest_tokens_per_second = sum(canary) / len(canary), sum(rest) / len(rest)
        if judgement.tokens_per_second < (1 - tolerance) * judgement.rest_tokens_per_second:
            judgement.verdict = FAIL
            judgement.reasons.append(f"tokens/s {judgement.tokens_per_second:.1f} below {1 - tolerance:.0%} of the "
                                     f"others' {judgement.rest_tokens_per_second:.1f}")


def judge(cfg: DraftopsConfig, state: dict, server: FleetReading | None, load: dict[str, EngineLoad]
          ) -> CanaryJudgement:
    """The canary against the other replicas (module docstring)."""
    n, names = state["windows"], state["replicas"]
    judgement = CanaryJudgement(state["version"], state.get("previous"), names, [], n)
    if server is None or not server.windows:
        judgement.reasons.append("no replica's windows were read (monitor.engines or monitor.prometheus_url)")
        return judgement
    t0 = datetime.fromisoformat(state.get("deployed_at") or state["started_at"])
    read = {name: _since(r, t0, n) for name, r in server.windows.items() if not r.error}
    short = [f"{c}: {len(read.get(c, []))} of {n} windows" for c in names if len(read.get(c, [])) < n]
    judgement.others = sorted(o for o, ws in read.items() if o not in names and len(ws) >= n)
    if short or not judgement.others:
        judgement.reasons += short or [f"no other replica has {n} windows since the canary was deployed"]
        return judgement
    fleet = {CANARY: ReplicaWindows(CANARY, recent=_merged([read[c] for c in names]))}
    fleet.update({o: ReplicaWindows(o, recent=read[o]) for o in judgement.others})
    test = outlier_tests(fleet, cfg.monitor.level).get(CANARY)
    if test is None:
        judgement.reasons.append("the windows leave no degrees of freedom for the test")
        return judgement
    judgement.acceptance, judgement.rest_acceptance = test.acceptance, test.rest_acceptance
    judgement.p_value, judgement.level = test.p_value, test.level
    failed = test.named and test.acceptance < test.rest_acceptance
    judgement.verdict = FAIL if failed else PASS
    if failed:
        judgement.reasons.append(f"acceptance {test.acceptance:.3f} parts from the others' {test.rest_acceptance:.3f}"
                                 f" (p={test.p_value:.3g} < {test.level:.3g})")
    _speed(judgement, load, cfg.monitor.deploy.canary.speed_tolerance)
    tokens = [w.counters.draft_tokens for ws in read.values() for w in ws if not w.counters.gauge]
    judgement.power = canary_power(n, len(judgement.others), cfg.monitor.level, POWER_DROPS,
                                   requests_per_window(tokens), seed=cfg.seed)
    return judgement

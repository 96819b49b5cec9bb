"""OK or DRIFT, and why: from the target fingerprint, the acceptance tests and the traffic drift.

DRIFT needs evidence that the champion got slower: a significant acceptance drop (paired or unpaired test, or the
window test of a serving engine's counters) or acceptance below break-even (measured by `draftops bench`, or
configured; without one there is no absolute alarm). A changed fingerprint or shifted traffic
alone is reported as a note, not an alarm: the draft may still fit. The cause of a DRIFT is what changed alongside it:
the target (fingerprint differs from the champion's tag), the traffic (token drift above threshold), both, or neither;
with neither, a drop that only the serving engine saw is "server_acceptance_dropped" (the offline measurement on
held-out traffic did not see it), any other "unexplained". A measurement that is not a finite number (NaN weights, an
overflow) is an ERROR, never OK: the check cannot tell whether the champion pays.

With several serving replicas (monitor.fleet.verdicts), `with_fleet` names the replicas that drifted, makes a fleet of
which no replica could be read an ERROR (one down is a note), and notes a replica whose acceptance parts from the
others'."""
# DEPLOY_MISMATCH is the post-deploy check's outcome (monitor.check.engine_acceptance): the serving engine's acceptance
# after a deploy is clearly below what the deployed draft measured offline, so the engine does not run the draft that
# was
# measured (a wrong or stale file, a misaligned vocabulary, an engine not reloaded). It outranks OK and DRIFT (no
# retraining can fix an engine that does not run the draft); an ERROR outranks it.
#
# DEPLOY_FAILED: a deploy this check ran (the champion not yet deployed, a promoted challenger, a rollback after a
# mismatch) failed, so the engine may not serve the champion (monitor.check.deploy_hooks). It outranks OK, DRIFT and
# DEPLOY_MISMATCH, whose reasons it keeps; an ERROR outranks it. Each has its own exit code, so that whatever watches
# exit codes sees it.
#
# REPLICA_DOWN: a replica unreachable at `monitor.replica_down_checks` checks in a row (monitor.fleet.verdicts) where
# the check would otherwise be OK; any other verdict outranks it and keeps the down replicas among its reasons.
#

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from monitor.fleet.offline_expectation import ENGINE_VS_OFFLINE
from monitor.fleet.verdicts import DEPLOY_MISMATCH, UNREACHABLE, FleetReading
from monitor.fleet.verdicts import DRIFT as REPLICA_DRIFT
from monitor.fleet.verdicts import ERROR as FLEET_ERROR
from monitor.stats.acceptance_tests import AcceptanceCheck, DropTest, PromptAcceptance, TrafficDrift, paired_drop_test

EXIT_OK, EXIT_ERROR, EXIT_DRIFT, EXIT_DEPLOY_MISMATCH, EXIT_DEPLOY_FAILED, EXIT_REPLICA_DOWN = 0, 2, 3, 4, 5, 6


class Status(str, Enum):
    OK = "OK"
    DRIFT = "DRIFT"
    ERROR = "ERROR"
    DEPLOY_MISMATCH = "DEPLOY_MISMATCH"
    DEPLOY_FAILED = "DEPLOY_FAILED"
    REPLICA_DOWN = "REPLICA_DOWN"


class Cause(str, Enum):
    TARGET_CHANGED = "target_changed"
    TRAFFIC_SHIFTED = "traffic_shifted"
    BOTH = "both"
    UNEXPLAINED = "unexplained"
    SERVER_ACCEPTANCE_DROPPED = "server_acceptance_dropped"


@dataclass(frozen=True)
class Decision:
    status: Status
    cause: Cause | None  # None when OK
    reasons: list[str] = field(default_factory=list)  # why DRIFT or ERROR (empty when OK)
    notes: list[str] = field(default_factory=list)  # changes that did not (yet) hurt acceptance

    @property
    def exit_code(self) -> int:
        return {Status.OK: EXIT_OK, Status.DRIFT: EXIT_DRIFT, Status.ERROR: EXIT_ERROR,
                Status.DEPLOY_MISMATCH: EXIT_DEPLOY_MISMATCH, Status.DEPLOY_FAILED: EXIT_DEPLOY_FAILED,
                Status.REPLICA_DOWN: EXIT_REPLICA_DOWN}[self.status]

    def to_dict(self) -> dict:
        return {"status": self.status.value, "cause": self.cause and self.cause.value,
                "reasons": self.reasons, "notes": self.notes, "exit_code": self.exit_code}


def non_finite(figures: dict[str, float | None]) -> list[str]:
    """A reason for each figure that is not a finite number (None counts as absent, not as an error)."""
    return [f"{name} is {value}, not a number the decision can use" for name, value in figures.items()
            if value is not None and not math.isfinite(value)]


def decide(
    *,
    champion_target_fingerprint: str | None,
    current_target_fingerprint: str,
    acceptance: AcceptanceCheck | None,
    drift: TrafficDrift | None,
    current_acceptance: float,
    break_even: float | None,
    acceptance_source: str = "analytic",
    server: DropTest | None = None,
) -> Decision:
    """The decision table. `current_acceptance` is the live acceptance when measured, else the analytic one; `server`
    is the window test of the serving engine's counters, when there is one."""
    target_changed = (
        champion_target_fingerprint is not None and champion_target_fingerprint != current_target_fingerprint
    )
    traffic_shifted = drift is not None and drift.drifted
    tests = (("paired (baseline prompts)", acceptance and acceptance.paired),
             ("unpaired (recent traffic)", acceptance and acceptance.unpaired))
    figures = {f"{acceptance_source} acceptance": current_acceptance, "break-even acceptance": break_even}
    for name, test in tests:
        if test is not None:
            figures.update({f"{name} baseline acceptance": test.baseline_acceptance,
                            f"{name} current acceptance": test.current_acceptance, f"{name} drop": test.drop})
    if server is not None:
        figures.update({"server baseline acceptance": server.baseline_acceptance,
                        "server current acceptance": server.current_acceptance, "server drop": server.drop})
    reasons = non_finite(figures)
    if reasons:
        return Decision(Status.ERROR, None, reasons, [])
    for name, test in tests:
        if test is not None and test.alarm:
            reasons.append(f"{name}: acceptance {test.baseline_acceptance:.3f} -> {test.current_acceptance:.3f}, "
                           f"drop {test.drop:.3f} > margin {test.margin:.3f} (p={test.p_value:.2g})")
    if break_even is not None and current_acceptance < break_even:
        reasons.append(f"{acceptance_source} acceptance {current_acceptance:.3f} below break-even {break_even:.3f}")
    server_only = server is not None and server.alarm and not reasons
    if server is not None and server.alarm:
        against = (f"the champion's offline figure on {server.n_baseline_prompts} prompts"
                   if server.method == ENGINE_VS_OFFLINE else f"{server.n_baseline_prompts} baseline")
        reasons.append(f"server windows ({server.n_current_prompts} recent vs {against}): acceptance "
                       f"{server.baseline_acceptance:.3f} -> {server.current_acceptance:.3f}, drop {server.drop:.3f} > "
                       f"margin {server.margin:.3f} (p={server.p_value:.2g})")

    notes: list[str] = []
    if champion_target_fingerprint is None:
        notes.append("champion has no target fingerprint tag")
    if target_changed:
        notes.append(f"target fingerprint {champion_target_fingerprint} -> {current_target_fingerprint}")
    if traffic_shifted:
        notes.append(f"traffic shifted: JS divergence {drift.js_divergence:.3f} >= {drift.threshold:.3f} "
                     f"(PSI {drift.psi:.2f})")

    if not reasons:
        return Decision(Status.OK, None, [], notes)
    if target_changed and traffic_shifted:
        cause = Cause.BOTH
    elif target_changed:
        cause = Cause.TARGET_CHANGED
    elif traffic_shifted:
        cause = Cause.TRAFFIC_SHIFTED
    elif server_only:
        cause = Cause.SERVER_ACCEPTANCE_DROPPED
    else:
        cause = Cause.UNEXPLAINED
    return Decision(Status.DRIFT, cause, reasons, notes)


def challenger_gate(
    champion: PromptAcceptance,
    challenger: PromptAcceptance,
    margin: float,
    level: float,
    method: str = "bootstrap",
    seed: int = 0,
    n_bootstrap: int = 2000,
) -> DropTest:
    """Promotion gate on the SAME held-out prompts: `alarm` (promote) iff the challenger's acceptance
    exceeds the champion's by more than `margin`, significantly at `level` (paired one-sided test).

    It is the paired drop test read from the challenger's side: drop = challenger - champion.
    """
    return paired_drop_test(challenger.acc, challenger.n, champion.acc, champion.n, margin, level, method, seed,
                            n_bootstrap)


def with_fleet(decision: Decision, fleet: FleetReading | None, mismatched: Sequence[str] = ()) -> Decision:
    """The check's decision once the fleet's reading is in (monitor.fleet.verdicts): ERROR when no replica could be read
    (its other reasons kept as notes); the drifting replicas named beside those that did not drift; a replica down,
    idle, collecting windows, or parting from the others, noted. `mismatched`: the replicas the post-deploy engine
    check found clearly below the deployed draft's figure (their verdict becomes DEPLOY_MISMATCH)."""
    if fleet is None:
        return decision
    for replica in fleet.replicas:
        if replica.name in mismatched:
            replica.verdict = DEPLOY_MISMATCH
    notes = list(decision.notes)
    if fleet.verdict == FLEET_ERROR:
        why = fleet.error or "; ".join(f"{r.name}: {r.error}" for r in fleet.replicas)
        reason = f"no serving replica could be read ({why})"
        if decision.status is Status.ERROR:
            return Decision(Status.ERROR, None, decision.reasons + [reason], notes)
        return Decision(Status.ERROR, None, [reason], [f"also: {r}" for r in decision.reasons] + notes)
    reasons = list(decision.reasons)
    drifted = fleet.named(REPLICA_DRIFT)
    if drifted and decision.status is Status.DRIFT:
        steady = [r.name for r in fleet.replicas if r.verdict not in (REPLICA_DRIFT, UNREACHABLE)]
        reasons.append(f"DRIFT on replica {', '.join(drifted)}" + (f", not on {', '.join(steady)}" if steady else ""))
    for replica in fleet.replicas:
        if replica.error:
            notes.append(f"replica {replica.name} unreachable: {replica.error}")
        notes.extend(f"replica {replica.name}: {note}" for note in replica.notes)
    for outlier in fleet.outliers():
        notes.append(f"replica {outlier.replica} parts from the others: acceptance {outlier.acceptance:.3f} vs "
                     f"{outlier.rest_acceptance:.3f} over the recent windows (p={outlier.p_value:.2g} < "
                     f"{outlier.level:.3g}; {outlier.method}): a stale target or an old draft file on that replica?")
    notes.extend(f"engines: {note}" for note in fleet.notes)
    down = [r for r in fleet.replicas if r.name in fleet.down]
    if down:
        reasons.append("replica down: " + ", ".join(f"{r.name} unreachable at {r.down_checks} checks in a row"
                                                     for r in down))
        if decision.status is Status.OK:
            return Decision(Status.REPLICA_DOWN, None, reasons, notes)
    return Decision(decision.status, decision.cause, reasons, notes)

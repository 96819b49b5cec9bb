"""A monitor check's measurements and decision, from what it read (monitor.check.observe): the champion measured on
the held-out traffic (paired with its baseline, unpaired on recent requests, live on a few), the engine check against
the offline figures, the tests and the decision (monitor.check.decision), and on DRIFT with retraining on, a
challenger distilled, loaded and gated. Apart from that challenger, nothing here reads the registry or the engines,
and nothing is logged: the baselines to record are returned (monitor.check.outcome logs them with the run)."""
from __future__ import annotations

import logging
from collections.abc import Callable

from monitor.check import boundary, engine_acceptance
from monitor.check.decision import Decision, Status, challenger_gate, decide, non_finite, with_fleet
from monitor.check.deploy_hooks import with_deploys
from monitor.check.engine_acceptance import EngineCheck
from monitor.check.observe import Observed
from monitor.check.outcome import CheckReport, RetrainOutcome
from monitor.check.prompt_acceptance import Baseline, Measurement, new_baseline
from monitor.release.rollout import DeployResult
from monitor.stats.acceptance_tests import AcceptanceCheck, DropTest, TrafficDrift, acceptance_check, traffic_drift
from pipeline import metrics as M
from pipeline import registry
from pipeline.config import DraftopsConfig

log = logging.getLogger("draftops.monitor")

Measure = Callable[[DraftopsConfig, object, object, list], Measurement]
ToRecord = list[tuple[str, Baseline]]  # (version, its new baseline), stored with the check's run


def assess(cfg: DraftopsConfig, seen: Observed, deployed: list[DeployResult], *, load: Callable, measure: Measure,
           measure_live_fn: Measure, retrain: Callable[[DraftopsConfig], str]) -> tuple[CheckReport, ToRecord]:
    """The check's report (its decision complete) and the baselines to record."""
    report = CheckReport(Decision(Status.OK, None), seen.name, seen.champion_version, seen.target.fingerprint,
                         seen.champion.tags.get(M.TARGET_FINGERPRINT_TAG), break_even=seen.break_even,
                         break_even_source=seen.break_even_source, server=seen.server, engine=seen.engine,
                         deploys=deployed, timings=seen.timings)
    if seen.baseline is None:
        to_record = _record_first_baseline(cfg, seen, report, measure)
    else:
        _compare_with_baseline(cfg, seen, report, measure, measure_live_fn)
        to_record = []
        if report.decision.status is Status.DRIFT and cfg.monitor.retrain:
            to_record = _retrain_and_gate(cfg, seen, report, retrain, load, measure)
    _complete_decision(cfg, seen, report)
    return report, to_record


def evaluate(cfg: DraftopsConfig, baseline: Baseline, current_fingerprint: str,
             champion_fingerprint: str | None, remeasured: Measurement | None, recent: Measurement | None,
             live: Measurement | None, break_even: float | None = None, server: DropTest | None = None
             ) -> tuple[AcceptanceCheck | None, TrafficDrift | None, float, str, Decision]:
    """Tests and decision from measurements alone (no models, no registry); break_even defaults to the config's;
    `server` is the serving engine's window test, if any."""
    m = cfg.monitor
    base = baseline.measurement
    acceptance = None
    if remeasured is not None or recent is not None:
        acceptance = acceptance_check(
            (base.subset(remeasured.request_ids).values, remeasured.values) if remeasured is not None else None,
            (base.values, recent.values) if recent is not None else None,
            m.margin, m.level, m.test_method, cfg.seed, m.n_bootstrap)
    drift = None
    if recent is not None and base.token_counts and recent.token_counts:
        drift = traffic_drift(base.token_counts, recent.token_counts, m.drift_threshold, m.drift_buckets)
    if live is not None:
        current, source = live.acceptance, "live"
    else:
        now = recent if recent is not None else remeasured
        current, source = (now.acceptance, "analytic") if now is not None else (base.acceptance, "baseline")
    decision = decide(champion_target_fingerprint=champion_fingerprint, current_target_fingerprint=current_fingerprint,
                      acceptance=acceptance, drift=drift, current_acceptance=current,
                      break_even=m.break_even_alpha if break_even is None else break_even,
                      acceptance_source=source, server=server)
    return acceptance, drift, current, source, decision


def _enough(requests: list) -> list | None:
    """A prompt-level test needs at least two prompts."""
    return requests if len(requests) >= 2 else None


def _enough_measured(measurement: Measurement | None, minimum: int = 2) -> Measurement | None:
    """Prompts with an empty response drop out of a measurement; too few left means no measurement."""
    return measurement if measurement is not None and len(measurement.request_ids) >= minimum else None


def _recent(cfg: DraftopsConfig, seen: Observed) -> list:
    return seen.heldout[-cfg.monitor.heldout_requests:]


def _compare_engine(cfg: DraftopsConfig, seen: Observed, engine: EngineCheck | None, champion: Measurement) -> None:
    """The engine check's windows against the offline figures: `champion`'s when the engine should serve the
    champion, else the stored baseline of the version it should serve; after a deploy, the previous version's too."""
    if engine is not None:
        own = champion if engine.version == seen.champion_version else seen.stored.get(engine.version)
        engine_acceptance.compare(engine, own, seen.stored.get(engine.previous_version or ""),
                                  cfg.monitor.deploy.mismatch_tolerance, cfg.monitor.level)


def _record_first_baseline(cfg: DraftopsConfig, seen: Observed, report: CheckReport, measure: Measure
                           ) -> list[tuple[str, Baseline]]:
    """No baseline yet: measure one on the most recent held-out requests; it is to be recorded (unless a figure is
    not finite: then ERROR, and nothing recorded)."""
    version, target = seen.champion_version, seen.target
    with seen.timings("measure_baseline"):
        measured = measure(cfg, target, seen.draft, _recent(cfg, seen))
    report.current_acceptance, report.n_baseline_prompts = measured.acceptance, len(measured.request_ids)
    notes = [f"no baseline for version {version}: recorded one"]
    if report.champion_target_fingerprint not in (None, target.fingerprint):
        notes.append(f"the champion was distilled for target {report.champion_target_fingerprint}, the baseline is "
                     f"measured on {target.fingerprint}: a drop caused by that change cannot be seen")
    errors = non_finite({"baseline acceptance": measured.acceptance})
    report.baseline_recorded = not errors  # a baseline that cannot be compared with is not recorded
    report.decision = Decision(Status.ERROR if errors else Status.OK, None, errors, [] if errors else notes)
    _compare_engine(cfg, seen, report.engine, measured)
    report.decision = engine_acceptance.with_engine(report.decision, report.engine)
    return [(version, new_baseline(target.fingerprint, measured))] if report.baseline_recorded else []


def _compare_with_baseline(cfg: DraftopsConfig, seen: Observed, report: CheckReport, measure: Measure,
                           measure_live_fn: Measure) -> None:
    """Measure the champion on the baseline's prompts (paired), on recent prompts the baseline has not seen
    (unpaired) and live on a few, compare the engine with the offline figure, and decide."""
    baseline, target, draft, timer = seen.baseline, seen.target, seen.draft, seen.timings
    by_id = {r.id: r for r in seen.heldout}
    seen_ids = set(baseline.measurement.request_ids)
    paired_requests = _enough([by_id[i] for i in baseline.measurement.request_ids if i in by_id])
    new_requests = _enough([r for r in _recent(cfg, seen) if r.id not in seen_ids])
    with timer("measure_paired"):
        remeasured = measure(cfg, target, draft, paired_requests) if paired_requests else None
    with timer("measure_recent"):
        recent = measure(cfg, target, draft, new_requests) if new_requests else None
    live = None
    live_requests = (new_requests or paired_requests or [])[:cfg.monitor.live_requests]
    if live_requests:
        with timer("measure_live"):
            live = _enough_measured(measure_live_fn(cfg, target, draft, live_requests), minimum=1)
    remeasured, recent = _enough_measured(remeasured), _enough_measured(recent)
    server, engine = report.server, report.engine
    _compare_engine(cfg, seen, engine, baseline.measurement)
    (report.acceptance, report.drift, report.current_acceptance, report.acceptance_source,
     report.decision) = evaluate(cfg, baseline, target.fingerprint, report.champion_target_fingerprint, remeasured,
                                 recent, live, report.break_even, (server and server.test) or (engine and engine.test))
    if report.acceptance is None:
        report.decision.notes.append("nothing to compare: the baseline's prompts left the traffic and there are "
                                     "no new held-out requests")
    report.decision = engine_acceptance.with_engine(report.decision, engine)
    report.n_baseline_prompts = len(remeasured.request_ids) if remeasured else 0
    report.n_recent_prompts = len(recent.request_ids) if recent else 0


def _retrain_and_gate(cfg: DraftopsConfig, seen: Observed, report: CheckReport,
                      retrain: Callable[[DraftopsConfig], str], load: Callable, measure: Measure
                      ) -> list[tuple[str, Baseline]]:
    """On DRIFT with retraining on: distill a challenger, gate it against the champion; a promoted one brings its
    baseline (to be recorded). A failure leaves the DRIFT standing, with a note."""
    try:
        with seen.timings("retrain"):
            version = retrain(cfg)
        with seen.timings("gate"):
            report.retrain, challenger_baseline = gate_challenger(
                cfg, seen.target, seen.draft, version, _recent(cfg, seen), load=load, measure=measure)
    except Exception as exc:  # the DRIFT stands and is tracked even when re-distillation fails
        log.exception("monitor: retraining failed")
        report.decision.notes.append(f"retraining failed: {type(exc).__name__}: {exc}")
        return []
    return [(version, challenger_baseline)] if report.retrain.promoted else []


def _complete_decision(cfg: DraftopsConfig, seen: Observed, report: CheckReport) -> None:
    """The fleet's reading (per-replica verdicts; counters that cannot be true: an ERROR), the traffic's size, and a
    deploy before the check that failed (DEPLOY_FAILED)."""
    m = cfg.monitor
    server, engine, n_heldout = report.server, report.engine, len(seen.heldout)
    report.decision = with_fleet(report.decision, server, engine.mismatched if engine is not None else [])
    boundary.watch(cfg, report, seen.load)
    if server is not None and report.baseline_recorded and server.test is not None:
        report.decision.notes.append("server metrics: the window test is logged, and decides once the champion has "
                                     "its offline baseline")
    impossible = [f"replica {r.name}: {r.error}" for r in (server.replicas if server is not None else [])
                  if r.error and "cannot be true" in r.error]
    if impossible:
        report.decision = Decision(Status.ERROR, None, report.decision.reasons + impossible, report.decision.notes)
    if n_heldout < m.heldout_requests:
        report.decision.notes.append(
            f"the traffic holds {n_heldout} held-out requests, fewer than monitor.heldout_requests="
            f"{m.heldout_requests}: measured on all of them (less power; see `draftops monitor simulate --n "
            f"{n_heldout}`)")
    report.decision = with_deploys(report.decision, report.deploys)


def gate_challenger(cfg: DraftopsConfig, target, champion_draft, challenger_version: str, requests: list, *,
                    load: Callable, measure: Measure) -> tuple[RetrainOutcome, Baseline]:
    """Measure champion and challenger on the same held-out prompts; promote only a significant gain."""
    _, challenger = load(cfg, registry.version_uri(cfg.tracking.registered_model, challenger_version), target)
    champion_m = measure(cfg, target, champion_draft, requests)
    challenger_m = measure(cfg, target, challenger, requests)
    common = [r for r in champion_m.request_ids if r in set(challenger_m.request_ids)]
    gate = challenger_gate(champion_m.subset(common).values, challenger_m.subset(common).values,
                           cfg.monitor.promote_margin, cfg.monitor.level, cfg.monitor.test_method, cfg.seed,
                           cfg.monitor.n_bootstrap)
    return (RetrainOutcome(challenger_version, gate, gate.alarm),
            new_baseline(target.fingerprint, challenger_m))

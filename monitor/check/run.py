"""One monitor check: does the champion draft still fit the current target and traffic?"""
# 1. Resolve the target (fingerprint) and `models:/NAME@champion` (its target-fingerprint tag, its baseline).
# 2. No baseline yet: measure one on the most recent N held-out requests, record it, report OK.
# 3. Else measure now: the champion on the baseline's own prompts (paired test) and on the most recent
#    held-out requests the baseline has not seen (unpaired test, token drift); live acceptance on a
#    few requests when configured. With `monitor.engines` (or `server_metrics_url`, or `prometheus_url`), also read
#    the serving replicas' windows and their window tests once enough windows exist (monitor.fleet.verdicts).
#    With `monitor.deploy`, first deploy the champion if it is not (monitor.check.deploy_hooks); after a deploy (or with
#    engine_check: always) read the engine's counters over a few windows and compare them with the offline figure of
#    the draft it should run (monitor.check.engine_acceptance).
# 4. Decide OK / DRIFT with its cause (monitor.check.decision), or DEPLOY_MISMATCH after a deploy the engine does not
#    show; ERROR when a figure is not finite or the engine's counters cannot be true.
# 5. On DRIFT with retraining on: distill a challenger, measure both on the same held-out prompts and
#    promote it only if it beats the champion by `promote_margin` (paired test); it brings its baseline.
# 6. Log the check as a run in the `draftops-monitor` experiment; then record the post-deploy check, roll the deployment
#    back on a mismatch (when configured), deploy a promoted challenger. A deploy of this check that failed, before or
#    after, makes it DEPLOY_FAILED (exit 5), in its report and its run's tags.
#
# `run_check` runs these as named steps: `_start` (1, the engine readings, the models), `_record_first_baseline` (2),
# `_compare_with_baseline` (3-4), `_retrain_and_gate` (5), `_complete_decision`, `_log_run` and `_deploy_after` (6).
#

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from decode.serving.loading import load_draft, load_model
from monitor.check import boundary, engine_acceptance
from monitor.check.decision import EXIT_ERROR, Decision, Status, challenger_gate, decide, non_finite, with_fleet
from monitor.check.deploy_hooks import deploy_after, deploy_before, with_deploys
from monitor.check.outcome import CheckReport, RetrainOutcome, _run_metrics, _run_tags
from monitor.check.prompt_acceptance import (
    Baseline,
    Measurement,
    heldout_by_recency,
    measure_analytic,
    measure_live,
    new_baseline,
)
from monitor.check.retrain import distill_challenger
from monitor.fleet import verdicts
from monitor.registry_report import monitor_checks, monitor_history_figure
from monitor.stats.acceptance_tests import AcceptanceCheck, DropTest, TrafficDrift, acceptance_check, traffic_drift
from pipeline import metrics as M
from pipeline import registry
from pipeline.config import DraftopsConfig
from pipeline.tracking import log_figure, setup_mlflow, start_run
from pipeline.traffic import TrafficError

log = logging.getLogger("draftops.monitor")

Measure = Callable[[DraftopsConfig, object, object, list], Measurement]


class _Timer(dict):
    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self[name] = self.get(name, 0.0) + time.perf_counter() - start


def load_models(cfg: DraftopsConfig, draft_source: str, target=None):
    """(target, draft) as ResolvedModels on the configured device (reusing `target` if given); tokenizers must agree."""

    target = target or load_model(cfg.target, device=cfg.device, dtype=cfg.dtype, cpu_linear=cfg.cpu_linear)
    return target, load_draft(draft_source, target, cpu_linear=cfg.cpu_linear)


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


@dataclass
class _Check:
    """What one check has gathered so far, handed from step to step."""

    cfg: DraftopsConfig
    champion: object  # the champion's registered version
    heldout: list
    target: object
    draft: object
    baseline: Baseline | None
    report: CheckReport
    timer: _Timer
    to_record: list[tuple[str, Baseline]] = field(default_factory=list)

    @property
    def recent_requests(self) -> list:
        return self.heldout[-self.cfg.monitor.heldout_requests:]


def run_check(cfg: DraftopsConfig, *, load: Callable = load_models, measure: Measure = measure_analytic,
              measure_live_fn: Measure = measure_live, retrain: Callable[[DraftopsConfig], str] | None = None,
              wait: Callable[[float], None] = time.sleep) -> CheckReport:
    """One check (see the module docstring). `load`, `measure*` and `retrain` are the model-facing steps; `wait(s)`
    lets the engine check's windows pass."""
    setup_mlflow(cfg)
    check = _start(cfg, load, wait)
    if check.baseline is None:
        _record_first_baseline(check, measure)
    else:
        _compare_with_baseline(check, measure, measure_live_fn)
        if check.report.decision.status is Status.DRIFT and cfg.monitor.retrain:
            _retrain_and_gate(check, retrain or distill_challenger, load, measure)
    _complete_decision(check)
    _log_run(check)
    _deploy_after(check)
    log.info("monitor check: %s", check.report.summary())
    return check.report


def _start(cfg: DraftopsConfig, load: Callable, wait: Callable[[float], None]) -> _Check:
    """Deploy the champion when it is not, resolve it and the held-out traffic, read the serving engine (its window
    since the last check, the engine check's windows when one is due), load the models and the stored baseline."""
    m, name = cfg.monitor, cfg.tracking.registered_model
    timer = _Timer()
    deploys = deploy_before(cfg)
    champ = registry.champion(name)
    heldout = heldout_by_recency(cfg)
    if not heldout:
        raise TrafficError(f"{cfg.traffic.path}: the held-out split is empty at traffic.heldout_fraction="
                           f"{cfg.traffic.heldout_fraction}; the check measures held-out requests only")
    server = None
    if verdicts.configured(cfg):
        with timer("server_metrics"):
            server = verdicts.read_fleet(cfg, champ.version)
    engine = engine_acceptance.due(cfg, champ.version)
    if engine is not None:
        with timer("engine_windows"):
            engine_acceptance.read_windows(cfg, engine, wait)
    with timer("load_models"):
        target, draft = load(cfg, registry.version_uri(name, champ.version))
    stored = registry.load_baseline(champ)
    break_even, break_even_source = registry.break_even(champ, m.break_even_alpha)
    report = CheckReport(Decision(Status.OK, None), name, champ.version, target.fingerprint,
                         champ.tags.get(M.TARGET_FINGERPRINT_TAG), break_even=break_even,
                         break_even_source=break_even_source, server=server, engine=engine, deploys=deploys,
                         timings=timer)
    return _Check(cfg, champ, heldout, target, draft, None if stored is None else Baseline.from_dict(stored), report,
                  timer)


def _record_first_baseline(check: _Check, measure: Measure) -> None:
    """No baseline yet: measure one on the most recent held-out requests and keep it to record (unless a figure is
    not finite: then ERROR, and nothing recorded)."""
    report, version, target = check.report, check.champion.version, check.target
    with check.timer("measure_baseline"):
        measured = measure(check.cfg, target, check.draft, check.recent_requests)
    check.to_record.append((version, new_baseline(target.fingerprint, measured)))
    report.baseline_recorded, report.current_acceptance = True, measured.acceptance
    report.n_baseline_prompts = len(measured.request_ids)
    notes = [f"no baseline for version {version}: recorded one"]
    if report.champion_target_fingerprint not in (None, target.fingerprint):
        notes.append(f"the champion was distilled for target {report.champion_target_fingerprint}, the baseline is "
                     f"measured on {target.fingerprint}: a drop caused by that change cannot be seen")
    errors = non_finite({"baseline acceptance": measured.acceptance})
    if errors:  # a baseline that cannot be compared with is not recorded
        check.to_record.clear()
        report.baseline_recorded = False
    report.decision = Decision(Status.ERROR if errors else Status.OK, None, errors, [] if errors else notes)
    if report.engine is not None:
        engine_acceptance.compare(check.cfg, report.engine, version, measured)
    report.decision = engine_acceptance.with_engine(report.decision, report.engine)


def _compare_with_baseline(check: _Check, measure: Measure, measure_live_fn: Measure) -> None:
    """Measure the champion on the baseline's prompts (paired), on recent prompts the baseline has not seen
    (unpaired) and live on a few, compare the engine with the offline figure, and decide."""
    cfg, report, baseline = check.cfg, check.report, check.baseline
    target, draft, timer = check.target, check.draft, check.timer
    by_id = {r.id: r for r in check.heldout}
    seen = set(baseline.measurement.request_ids)
    paired_requests = _enough([by_id[i] for i in baseline.measurement.request_ids if i in by_id])
    new_requests = _enough([r for r in check.recent_requests if r.id not in seen])
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
    if engine is not None:
        engine_acceptance.compare(cfg, engine, check.champion.version, baseline.measurement)
    (report.acceptance, report.drift, report.current_acceptance, report.acceptance_source,
     report.decision) = evaluate(cfg, baseline, target.fingerprint, report.champion_target_fingerprint, remeasured,
                                 recent, live, report.break_even, (server and server.test) or (engine and engine.test))
    if report.acceptance is None:
        report.decision.notes.append("nothing to compare: the baseline's prompts left the traffic and there are "
                                     "no new held-out requests")
    report.decision = engine_acceptance.with_engine(report.decision, engine)
    report.n_baseline_prompts = len(remeasured.request_ids) if remeasured else 0
    report.n_recent_prompts = len(recent.request_ids) if recent else 0


def _retrain_and_gate(check: _Check, retrain: Callable[[DraftopsConfig], str], load: Callable,
                      measure: Measure) -> None:
    """On DRIFT with retraining on: distill a challenger, gate it against the champion; a promoted one brings its
    baseline. A failure leaves the DRIFT standing, with a note."""
    report = check.report
    try:
        with check.timer("retrain"):
            version = retrain(check.cfg)
        with check.timer("gate"):
            report.retrain, challenger_baseline = gate_challenger(
                check.cfg, check.target, check.draft, version, check.recent_requests, load=load, measure=measure)
    except Exception as exc:  # the DRIFT stands and is tracked even when re-distillation fails
        log.exception("monitor: retraining failed")
        report.decision.notes.append(f"retraining failed: {type(exc).__name__}: {exc}")
    else:
        if report.retrain.promoted:
            check.to_record.append((version, challenger_baseline))

def _complete_decision(check: _Check) -> None:
    """The fleet's reading (per-replica verdicts; counters that cannot be true: an ERROR), the traffic's size, and a
    deploy before the check that failed (DEPLOY_FAILED)."""
    report, m = check.report, check.cfg.monitor
    server, engine, n_heldout = report.server, report.engine, len(check.heldout)
    report.decision = with_fleet(report.decision, server, engine.mismatched if engine is not None else [])
    boundary.watch(check.cfg, report)
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


def _log_run(check: _Check) -> None:
    """The check as a run in `draftops-monitor`: the baselines stored, then the alias moved to a promoted challenger,
    the metrics, the report and the history figure."""
    import mlflow
    from mlflow import MlflowClient

    report, name = check.report, check.cfg.tracking.registered_model
    with start_run(check.cfg, "monitor", run_name=f"check-{report.decision.status.value.lower()}",
                   tags=_run_tags(report)) as run:
        report.run_id = run.info.run_id
        for version, new in check.to_record:
            registry.save_baseline(name, version, new.to_dict())
        # the alias moves only once the new champion's baseline is stored: stopped at any point before, the old
        # champion serves with its own baseline; after, the new one has its baseline
        if report.retrain is not None and report.retrain.promoted:
            report.retrain.previous_champion = registry.promote(name, report.retrain.challenger_version)
        mlflow.log_metrics(_run_metrics(report, check.cfg.monitor.margin))
        mlflow.log_dict(report.to_dict(), "monitor/report.json")
        checks = monitor_checks(MlflowClient(), name, limit=100)  # this check included: its metrics are logged
        log_figure(monitor_history_figure(checks), "monitor/history.png")


def _deploy_after(check: _Check) -> None:
    """The deploys after the run (monitor.check.deploy_hooks); one that fails makes the check DEPLOY_FAILED, and its
    run, logged before, is tagged and its report written again."""
    from mlflow import MlflowClient

    report = check.report
    before = len(report.deploys)
    deploy_after(check.cfg, report)
    decision = with_deploys(report.decision, report.deploys[before:])
    if decision is report.decision:
        return
    report.decision = decision
    client = MlflowClient()
    for key, value in {**_run_tags(report), "mlflow.runName": f"check-{decision.status.value.lower()}"}.items():
        client.set_tag(report.run_id, key, value)
    client.log_metric(report.run_id, M.MONITOR_DEPLOY_FAILED, 1.0)
    client.log_dict(report.run_id, report.to_dict(), "monitor/report.json")


def gate_challenger(cfg: DraftopsConfig, target, champion_draft, challenger_version: str, requests: list, *,
                    load: Callable = load_models, measure: Measure = measure_analytic
                    ) -> tuple[RetrainOutcome, Baseline]:
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


def scheduled_check(cfg: DraftopsConfig) -> CheckReport | int:
    """What the service runs (under its lock): a check with retraining as configured; its report (the service
    records and alerts on it), or the exit code of a check that could not report."""
    try:
        return run_check(cfg)
    except registry.RegistryError as exc:
        log.error("monitor check: %s", exc)
        return EXIT_ERROR


def rollback(cfg: DraftopsConfig, to_version: str | None = None) -> str:
    """Move the champion alias back (to previous-champion or `to_version`) and record it as a monitor run."""

    setup_mlflow(cfg)
    name = cfg.tracking.registered_model
    before = registry.champion(name).version
    after = registry.rollback(name, to_version)
    with start_run(cfg, "monitor", run_name="rollback",
                   tags={M.MONITOR_DECISION_TAG: "ROLLBACK", M.MONITOR_ROLLED_BACK_FROM_TAG: before,
                         M.MONITOR_CHAMPION_VERSION_TAG: after}):
        pass
    return after

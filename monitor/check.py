"""One monitor check: does the champion draft still fit the current target and traffic?

1. Resolve the target (fingerprint) and `models:/NAME@champion` (its target-fingerprint tag, its baseline).
2. No baseline yet: measure one on the most recent N held-out requests, record it, report OK.
3. Else measure now: the champion on the baseline's own prompts (paired test) and on the most recent
   held-out requests the baseline has not seen (unpaired test, token drift); live acceptance on a
   few requests when configured. With `monitor.server_metrics_url`, also read the serving engine's
   counters: the window since the last check, and the window test once enough windows exist
   (monitor.server_metrics).
4. Decide OK / DRIFT with its cause (monitor.decision).
5. On DRIFT with retraining on: distill a challenger, measure both on the same held-out prompts and
   promote it only if it beats the champion by `promote_margin` (paired test); it brings its baseline.
6. Log the check as a run in the `draftops-monitor` experiment.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from decode.serving.loading import load_draft, load_model
from monitor.decision import EXIT_ERROR, Decision, Status, challenger_gate, decide, non_finite
from monitor.measure import Baseline, Measurement, heldout_by_recency, measure_analytic, measure_live, new_baseline
from monitor.report import monitor_checks, monitor_history_figure
from monitor.retrain import distill_challenger
from monitor.server_metrics import ServerReading, read_server
from monitor.stats import AcceptanceCheck, DropTest, TrafficDrift, acceptance_check, traffic_drift
from pipeline import metrics as M
from pipeline import registry
from pipeline.config import DraftopsConfig
from pipeline.tracking import log_figure, setup_mlflow, start_run
from pipeline.traffic import TrafficError

log = logging.getLogger("draftops.monitor")

Measure = Callable[[DraftopsConfig, object, object, list], Measurement]


@dataclass
class RetrainOutcome:
    challenger_version: str
    gate: DropTest  # drop = challenger - champion acceptance on the same held-out prompts
    promoted: bool
    previous_champion: str | None = None

    def to_dict(self) -> dict:
        return {"challenger_version": self.challenger_version, "gate": self.gate.to_dict(),
                "promoted": self.promoted, "previous_champion": self.previous_champion}


@dataclass
class CheckReport:
    decision: Decision
    registered_model: str
    champion_version: str
    target_fingerprint: str
    champion_target_fingerprint: str | None
    acceptance: AcceptanceCheck | None = None
    drift: TrafficDrift | None = None
    current_acceptance: float | None = None
    acceptance_source: str = "analytic"
    break_even: float = 0.0
    break_even_source: str = "monitor.break_even_alpha"
    n_baseline_prompts: int = 0
    n_recent_prompts: int = 0
    baseline_recorded: bool = False
    retrain: RetrainOutcome | None = None
    server: ServerReading | None = None
    timings: dict[str, float] = field(default_factory=dict)
    run_id: str | None = None

    @property
    def exit_code(self) -> int:
        return self.decision.exit_code

    def to_dict(self) -> dict:
        return {
            **self.decision.to_dict(),
            "registered_model": self.registered_model, "champion_version": self.champion_version,
            "target_fingerprint": self.target_fingerprint,
            "champion_target_fingerprint": self.champion_target_fingerprint,
            "acceptance": self.acceptance and self.acceptance.to_dict(), "drift": self.drift and self.drift.to_dict(),
            "current_acceptance": self.current_acceptance, "acceptance_source": self.acceptance_source,
            "break_even": self.break_even, "break_even_source": self.break_even_source,
            "n_baseline_prompts": self.n_baseline_prompts,
            "n_recent_prompts": self.n_recent_prompts, "baseline_recorded": self.baseline_recorded,
            "retrain": self.retrain and self.retrain.to_dict(), "server": self.server and self.server.to_dict(),
            "timings": self.timings, "run_id": self.run_id,
        }

    def summary(self) -> str:
        d = self.decision
        lines = [f"{d.status.value}{f' ({d.cause.value})' if d.cause else ''}: "
                 f"{self.registered_model}@champion = version {self.champion_version}"]
        if self.baseline_recorded:
            lines.append(f"  baseline recorded on {self.n_baseline_prompts} held-out prompts "
                         f"(acceptance {self.current_acceptance:.3f})")
        for name, test in (("paired", self.acceptance and self.acceptance.paired),
                           ("unpaired", self.acceptance and self.acceptance.unpaired)):
            if test is not None:
                lines.append(f"  {name}: {test.baseline_acceptance:.3f} -> {test.current_acceptance:.3f}, drop "
                             f"{test.drop:+.3f} [{test.ci_low:+.3f}, {test.ci_high:+.3f}], p={test.p_value:.3g} "
                             f"({test.n_current_prompts} prompts)")
        if self.drift is not None:
            lines.append(f"  traffic: JS {self.drift.js_divergence:.3f} bits (threshold {self.drift.threshold}), "
                         f"PSI {self.drift.psi:.2f}")
        server = self.server.summary() if self.server is not None else ""
        if server:
            lines.append(server)
        lines += [f"  reason: {r}" for r in d.reasons] + [f"  note: {n}" for n in d.notes]
        if self.retrain is not None:
            r = self.retrain
            lines.append(f"  challenger version {r.challenger_version}: gain {r.gate.drop:+.3f} "
                         f"(p={r.gate.p_value:.3g}) -> {'PROMOTED' if r.promoted else 'not promoted'}")
        if self.run_id:
            lines.append(f"  MLflow run {self.run_id} (experiment draftops-monitor)")
        return "\n".join(lines)


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


def run_check(cfg: DraftopsConfig, *, load: Callable = load_models, measure: Measure = measure_analytic,
              measure_live_fn: Measure = measure_live, retrain: Callable[[DraftopsConfig], str] | None = None
              ) -> CheckReport:
    """One check (see the module docstring). `load`, `measure*` and `retrain` are the model-facing steps."""
    import mlflow
    from mlflow import MlflowClient

    retrain = retrain or distill_challenger
    setup_mlflow(cfg)
    m, name = cfg.monitor, cfg.tracking.registered_model
    timer = _Timer()
    champ = registry.champion(name)
    champion_fingerprint = champ.tags.get(M.TARGET_FINGERPRINT_TAG)
    heldout = heldout_by_recency(cfg)
    if not heldout:
        raise TrafficError(f"{cfg.traffic.path}: the held-out split is empty at traffic.heldout_fraction="
                           f"{cfg.traffic.heldout_fraction}; the check measures held-out requests only")
    server = None
    if m.server_metrics_url:
        with timer("server_metrics"):
            server = read_server(cfg, champ.version)
    with timer("load_models"):
        target, draft = load(cfg, registry.version_uri(name, champ.version))
    recent_requests = heldout[-m.heldout_requests:]
    stored = registry.load_baseline(champ)
    baseline = None if stored is None else Baseline.from_dict(stored)
    break_even, break_even_source = registry.break_even(champ, m.break_even_alpha)
    report = CheckReport(Decision(Status.OK, None), name, champ.version, target.fingerprint, champion_fingerprint,
                         break_even=break_even, break_even_source=break_even_source, server=server, timings=timer)
    to_record: list[tuple[str, Baseline]] = []

    if baseline is None:
        with timer("measure_baseline"):
            measured = measure(cfg, target, draft, recent_requests)
        to_record.append((champ.version, new_baseline(target.fingerprint, measured)))
        report.baseline_recorded, report.current_acceptance = True, measured.acceptance
        report.n_baseline_prompts = len(measured.request_ids)
        notes = [f"no baseline for version {champ.version}: recorded one"]
        if champion_fingerprint not in (None, target.fingerprint):
            notes.append(f"the champion was distilled for target {champion_fingerprint}, the baseline is measured on "
                         f"{target.fingerprint}: a drop caused by that change cannot be seen")
        errors = non_finite({"baseline acceptance": measured.acceptance})
        if errors:  # a baseline that cannot be compared with is not recorded
            to_record.clear()
            report.baseline_recorded = False
        report.decision = Decision(Status.ERROR if errors else Status.OK, None, errors, [] if errors else notes)
    else:
        by_id = {r.id: r for r in heldout}
        seen = set(baseline.measurement.request_ids)
        paired_requests = _enough([by_id[i] for i in baseline.measurement.request_ids if i in by_id])
        new_requests = _enough([r for r in recent_requests if r.id not in seen])
        with timer("measure_paired"):
            remeasured = measure(cfg, target, draft, paired_requests) if paired_requests else None
        with timer("measure_recent"):
            recent = measure(cfg, target, draft, new_requests) if new_requests else None
        live = None
        live_requests = (new_requests or paired_requests or [])[:m.live_requests]
        if live_requests:
            with timer("measure_live"):
                live = _enough_measured(measure_live_fn(cfg, target, draft, live_requests), minimum=1)
        remeasured, recent = _enough_measured(remeasured), _enough_measured(recent)
        (report.acceptance, report.drift, report.current_acceptance, report.acceptance_source,
         report.decision) = evaluate(cfg, baseline, target.fingerprint, champion_fingerprint, remeasured, recent,
                                     live, break_even, server and server.test)
        if report.acceptance is None:
            report.decision.notes.append("nothing to compare: the baseline's prompts left the traffic and there are "
                                         "no new held-out requests")
        report.n_baseline_prompts = len(remeasured.request_ids) if remeasured else 0
        report.n_recent_prompts = len(recent.request_ids) if recent else 0
        if report.decision.status is Status.DRIFT and m.retrain:
            try:
                with timer("retrain"):
                    version = retrain(cfg)
                with timer("gate"):
                    report.retrain, challenger_baseline = gate_challenger(
                        cfg, target, draft, version, recent_requests, load=load, measure=measure)
            except Exception as exc:  # the DRIFT stands and is tracked even when re-distillation fails
                log.exception("monitor: retraining failed")
                report.decision.notes.append(f"retraining failed: {type(exc).__name__}: {exc}")
            else:
                if report.retrain.promoted:
                    to_record.append((version, challenger_baseline))

    if server is not None:
        report.decision.notes.extend(f"server metrics: {note}" for note in
                                     ([f"not read: {server.error}"] if server.error else server.notes))
        if report.baseline_recorded and server.test is not None:
            report.decision.notes.append("server metrics: the window test is logged, and decides once the champion "
                                         "has its offline baseline")
    if len(heldout) < m.heldout_requests:
        report.decision.notes.append(
            f"the traffic holds {len(heldout)} held-out requests, fewer than monitor.heldout_requests="
            f"{m.heldout_requests}: measured on all of them (less power; see `draftops monitor simulate --n "
            f"{len(heldout)}`)")
    with start_run(cfg, "monitor", run_name=f"check-{report.decision.status.value.lower()}",
                   tags=_run_tags(report)) as run:
        report.run_id = run.info.run_id
        for version, new in to_record:
            registry.save_baseline(name, version, new.to_dict())
        # the alias moves only once the new champion's baseline is stored: stopped at any point before, the old
        # champion serves with its own baseline; after, the new one has its baseline
        if report.retrain is not None and report.retrain.promoted:
            report.retrain.previous_champion = registry.promote(name, report.retrain.challenger_version)
        mlflow.log_metrics(_run_metrics(report, m.margin))
        mlflow.log_dict(report.to_dict(), "monitor/report.json")
        checks = monitor_checks(MlflowClient(), name, limit=100)  # this check included: its metrics are logged
        log_figure(monitor_history_figure(checks), "monitor/history.png")
    log.info("monitor check: %s", report.summary())
    return report


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


def _run_tags(report: CheckReport) -> dict[str, str]:
    d = report.decision
    tags = {M.MONITOR_DECISION_TAG: d.status.value, M.MONITOR_CAUSE_TAG: d.cause.value if d.cause else "",
            M.MONITOR_CHAMPION_VERSION_TAG: report.champion_version,
            M.TARGET_FINGERPRINT_TAG: report.target_fingerprint,
            M.MONITOR_CHAMPION_TARGET_FINGERPRINT_TAG: report.champion_target_fingerprint or "",
            M.MONITOR_ACCEPTANCE_SOURCE_TAG: report.acceptance_source,
            M.REGISTERED_MODEL_TAG: report.registered_model}
    if report.retrain is not None:
        tags[M.MONITOR_CHALLENGER_VERSION_TAG] = report.retrain.challenger_version
        tags[M.MONITOR_PROMOTED_TAG] = str(report.retrain.promoted).lower()
    return tags


def _run_metrics(report: CheckReport, margin: float) -> dict[str, float]:
    """The check under `pipeline.metrics` names. The unprefixed drop test is the paired one when there is one
    (same prompts as the baseline), else the unpaired one; both are also logged under monitor/paired|unpaired/."""
    out: dict[str, float] = {M.seconds(k): v for k, v in report.timings.items()}
    out[M.MONITOR_TARGET_CHANGED] = float(report.champion_target_fingerprint not in (None, report.target_fingerprint))
    out[M.MONITOR_DRIFT] = float(report.decision.status is Status.DRIFT)
    out[M.MONITOR_ERROR] = float(report.decision.status is Status.ERROR)
    out[M.MONITOR_BREAK_EVEN] = report.break_even
    out[M.MONITOR_ACCEPTANCE_NOW] = report.current_acceptance
    if report.acceptance_source == "live":  # the draft decoding alone: the same figure eval and bench report
        out[M.ACCEPTANCE_DRAFT] = report.current_acceptance
    if report.baseline_recorded:
        out[M.MONITOR_ACCEPTANCE_BASELINE] = report.current_acceptance
    tests = [(name, test) for name, test in (("paired", report.acceptance and report.acceptance.paired),
                                              ("unpaired", report.acceptance and report.acceptance.unpaired))
             if test is not None]
    for name, test in tests:
        figures = {"acceptance_baseline": test.baseline_acceptance, "acceptance_now": test.current_acceptance,
                   "drop": test.drop, "drop_ci_low": test.ci_low, "drop_ci_high": test.ci_high,
                   "p_value": test.p_value, "prompts": test.n_current_prompts}
        out.update({M.monitor_test(name, k): v for k, v in figures.items()})
    if tests:
        main = tests[0][1]
        out.update({M.MONITOR_ACCEPTANCE_BASELINE: main.baseline_acceptance, M.MONITOR_DROP: main.drop,
                    M.MONITOR_DROP_CI_LOW: main.ci_low, M.MONITOR_DROP_CI_HIGH: main.ci_high,
                    M.MONITOR_P_VALUE: main.p_value})
    if M.MONITOR_ACCEPTANCE_BASELINE in out:
        out[M.MONITOR_ACCEPTANCE_THRESHOLD] = out[M.MONITOR_ACCEPTANCE_BASELINE] - margin
    if report.drift is not None:
        out.update({M.MONITOR_TRAFFIC_JS: report.drift.js_divergence, M.MONITOR_TRAFFIC_PSI: report.drift.psi})
    if report.retrain is not None:
        out.update({M.MONITOR_GATE_GAIN: report.retrain.gate.drop, M.MONITOR_GATE_P_VALUE: report.retrain.gate.p_value,
                    M.MONITOR_PROMOTED: float(report.retrain.promoted)})
    if report.server is not None:
        out.update(_server_metrics(report.server))
    return M.finite(out)


def _server_metrics(server: ServerReading) -> dict[str, float]:
    """The serving engine's window (acceptance, by draft position, its size) and window test, when there are."""
    out: dict[str, float] = {}
    if server.window is not None:
        c = server.window.counters
        out.update({M.ACCEPTANCE_SERVER: c.acceptance, M.monitor_test("server", "draft_tokens"): c.draft_tokens,
                    M.monitor_test("server", "drafts"): c.drafts})
        out.update({M.server_position(i + 1): a for i, a in enumerate(c.position_acceptance())})
    if server.test is not None:
        t = server.test
        figures = {"acceptance_baseline": t.baseline_acceptance, "acceptance_now": t.current_acceptance,
                   "drop": t.drop, "drop_ci_low": t.ci_low, "drop_ci_high": t.ci_high, "p_value": t.p_value,
                   "windows": t.n_current_prompts}
        out.update({M.monitor_test("server", k): v for k, v in figures.items()})
    return out


def scheduled_check(cfg: DraftopsConfig) -> int:
    """What the service runs (under its lock): a check with retraining as configured; returns the exit code."""
    try:
        return run_check(cfg).exit_code
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

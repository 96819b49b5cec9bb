"""A monitor check's report: what it decided and measured, its printed summary, its MLflow tags and metrics (under
`pipeline.metrics` names), and its run in MLflow (`log_run`: the baselines stored with it, then a promotion)."""

from __future__ import annotations

from dataclasses import dataclass, field

from monitor.check.decision import Decision, Status
from monitor.check.engine_acceptance import EngineCheck
from monitor.fleet.verdicts import FleetReading
from monitor.registry_report import monitor_checks, monitor_history_figure
from monitor.release.rollout import FAILED, DeployResult
from monitor.stats.acceptance_tests import AcceptanceCheck, DropTest, TrafficDrift
from pipeline import metrics as M
from pipeline import registry
from pipeline.config import DraftopsConfig
from pipeline.tracking import log_figure, start_run


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
    break_even: float | None = None  # None: no bench run and none configured, no absolute alarm
    break_even_source: str = "monitor.break_even_alpha"
    n_baseline_prompts: int = 0
    n_recent_prompts: int = 0
    baseline_recorded: bool = False
    retrain: RetrainOutcome | None = None
    server: FleetReading | None = None
    engine: EngineCheck | None = None
    deploys: list[DeployResult] = field(default_factory=list)  # catch-up, after promotion, rollback on mismatch
    canary: object | None = None  # monitor.check.canary.CanaryJudgement: a canary judged by this check
    load: dict[str, list] = field(default_factory=dict)  # replica -> [running requests, past the boundary]
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
            "engine": self.engine and self.engine.to_dict(), "deploys": [r.to_dict() for r in self.deploys],
            "canary": self.canary and self.canary.to_dict(), "load": self.load,
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
        if self.engine is not None:
            lines.append(self.engine.summary())
        if self.break_even is None:
            lines.append(f"  break-even: {self.break_even_source}: no absolute alarm")
        lines += [f"  reason: {r}" for r in d.reasons] + [f"  note: {n}" for n in d.notes]
        if self.retrain is not None:
            r = self.retrain
            lines.append(f"  challenger version {r.challenger_version}: gain {r.gate.drop:+.3f} "
                         f"(p={r.gate.p_value:.3g}) -> {'PROMOTED' if r.promoted else 'not promoted'}")
        lines += [self.canary.summary()] if self.canary is not None else []
        lines += ["  " + r.summary().replace("\n", "\n  ") for r in self.deploys]
        if self.run_id:
            lines.append(f"  MLflow run {self.run_id} (experiment draftops-monitor)")
        return "\n".join(lines)


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
    out[M.MONITOR_DEPLOY_MISMATCH] = float(report.decision.status is Status.DEPLOY_MISMATCH)
    out[M.MONITOR_DEPLOY_FAILED] = float(any(r.action == FAILED for r in report.deploys))
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
    if report.engine is not None:
        out.update(_engine_metrics(report.engine))
    return M.finite(out)


def _engine_metrics(engine: EngineCheck) -> dict[str, float]:
    """The engine check's acceptance over its windows, the offline figure it was compared with, and the tests."""
    out = {M.ENGINE_ACCEPTANCE: engine.acceptance, M.ENGINE_EXPECTED: engine.expected,
           M.ENGINE_MISMATCH: float(engine.mismatch)}
    for name, test in (("engine", engine.test), ("engine_pre_drift", engine.pre_drift)):
        if test is not None:
            out.update({M.monitor_test(name, k): v for k, v in (
                ("acceptance_offline", test.baseline_acceptance), ("drop", test.drop), ("drop_ci_low", test.ci_low),
                ("p_value", test.p_value), ("windows", test.n_current_prompts))})
    return out


def _server_metrics(server: FleetReading) -> dict[str, float]:
    """The fleet's latest window (acceptance, by draft position, its size) and decisive window test, when there are;
    each replica's latest acceptance and window test."""
    out: dict[str, float] = {}
    for replica in server.replicas:
        if replica.latest is not None:
            out[M.replica_metric(replica.name, "acceptance")] = replica.latest.counters.acceptance
        if replica.test is not None:
            out.update({M.replica_metric(replica.name, "drop"): replica.test.drop,
                        M.replica_metric(replica.name, "p_value"): replica.test.p_value})
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


def log_run(cfg: DraftopsConfig, report: CheckReport, to_record: list) -> None:
    """The check as a run in `draftops-monitor`: the baselines `to_record` ((version, Baseline)) stored, then the
    alias moved to a promoted challenger, the metrics, the report and the history figure."""
    import mlflow
    from mlflow import MlflowClient

    name = report.registered_model
    with start_run(cfg, "monitor", run_name=f"check-{report.decision.status.value.lower()}",
                   tags=_run_tags(report)) as run:
        report.run_id = run.info.run_id
        for version, new in to_record:
            registry.save_baseline(name, version, new.to_dict())
        # the alias moves only once the new champion's baseline is stored: stopped at any point before, the old
        # champion serves with its own baseline; after, the new one has its baseline
        if report.retrain is not None and report.retrain.promoted:
            report.retrain.previous_champion = registry.promote(name, report.retrain.challenger_version)
        mlflow.log_metrics(_run_metrics(report, cfg.monitor.margin))
        mlflow.log_dict(report.to_dict(), "monitor/report.json")
        checks = monitor_checks(MlflowClient(), name, limit=100)  # this check included: its metrics are logged
        log_figure(monitor_history_figure(checks), "monitor/history.png")


def log_deploy_failure(report: CheckReport) -> None:
    """A deploy after the run failed (the report's decision now DEPLOY_FAILED): its run tagged and its report
    written again."""
    from mlflow import MlflowClient

    client = MlflowClient()
    for key, value in {**_run_tags(report), "mlflow.runName": f"check-{report.decision.status.value.lower()}"}.items():
        client.set_tag(report.run_id, key, value)
    client.log_metric(report.run_id, M.MONITOR_DEPLOY_FAILED, 1.0)
    client.log_dict(report.run_id, report.to_dict(), "monitor/report.json")

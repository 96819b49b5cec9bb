"""`make serve-demo`: the nightly loop through a running engine, on this machine (configs/serve_demo.yaml).

1. distill a champion against the original target (version 1);
2. llama-server serves the original target's GGUF; version 1 is deployed to it (exported as GGUF into the deploy
   folder, `current` flipped, the engine restarted with the draft through its reload endpoint: monitor.release);
3. check: the post-deploy check reads the engine's counters over windows of replayed held-out prompts and confirms the
   draft's offline figure; the baseline is recorded: OK;
4. the target update (`target finetune`: LoRA, merged) is written as the served GGUF and rolled out to the engine;
5. check: the engine's acceptance is clearly below the champion's offline figure, and the offline test agrees: DRIFT
   (target changed); a challenger is distilled warm from the champion, gated, promoted and deployed (the engine
   restarted with the new draft);
6. check: the post-deploy check confirms the new draft in the engine and compares it with the pre-drift figure;
7. with `--rehearse-mismatch`: the engine restarted with the old draft's file while the new one is deployed: the
   post-deploy check says DEPLOY_MISMATCH (exit code 4) and rolls the deployment back;
8. llama.cpp with the draft against llama.cpp alone on the same prompts (monitor.fleet.speed).

The summary prints the engine's acceptance per window in each phase with the offline figures, the decisions, the
checks, the time per phase, and the speed table; the demo's runs (distill, checks, target update, deploys, the
summary) are in MLflow. Like `make drift-demo`, it owns `--out` and its registered model and starts them afresh.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from transformers import AutoTokenizer

from decode.serving.export import draft_source, export_format, target_gguf
from distill.train import run_distill
from monitor.check.decision import Status
from monitor.fleet.speed import measure_speed, settings_for, speed_table
from monitor.rehearsal.demo_engine import Replayer, ServedEngine, write_target_gguf
from monitor.rehearsal.drift_demo import (
    Phases,
    claim_model,
    decision_label,
    demo_configs,
    locked_check,
    start_afresh,
)
from monitor.rehearsal.target_update import run_finetune
from monitor.release.layout import CURRENT, PREVIOUS, DeployFolder
from monitor.release.rollout import deploy_champion
from pipeline import metrics as M
from pipeline import registry
from pipeline.config import DraftopsConfig, save_config
from pipeline.sources import locate
from pipeline.tracking import setup_mlflow, start_run, tracking_uri
from pipeline.traffic import encode_prompts, heldout_by_recency

DEFAULT_OUT = "outputs/serve-demo"
OWNED_DIRS = ("distill", "monitor", "target-updated", "deploy", "engine", "speed")
SPEED_PROMPTS = 8


@dataclass
class ServeDemoResult:
    decisions: list[str] = field(default_factory=list)
    windows: dict[str, list[float]] = field(default_factory=dict)  # phase -> engine acceptance per window
    offline: dict[str, float | None] = field(default_factory=dict)  # phase -> the draft's offline figure (engine terms)
    champion_before: str | None = None
    champion_after: str | None = None
    deployed_after: str | None = None
    drift_from_engine: bool = False
    confirmed: bool = False
    recovered: bool | None = None
    mismatch_caught: bool | None = None  # only with the rehearsal
    phases: list[tuple[str, float]] = field(default_factory=list)
    speed: list = field(default_factory=list)

    @property
    def checks(self) -> list[tuple[str, bool]]:
        checks = [
            ("decisions OK -> DRIFT(target_changed) -> OK",
             self.decisions[:3] == ["OK", "DRIFT(target_changed)", "OK"]),
            ("the drift seen in the engine's counters (clearly below the champion's offline figure)",
             self.drift_from_engine),
            ("a new version promoted and deployed (current -> it, engine reloaded)",
             self.champion_after not in (None, self.champion_before) and self.deployed_after == self.champion_after),
            ("post-deploy check: the engine confirms the new draft", self.confirmed),
            ("the engine's acceptance recovered (not clearly below the pre-drift figure)", self.recovered is True),
        ]
        if self.mismatch_caught is not None:
            checks.append(("a wrong deployment (the old draft's file) caught: DEPLOY_MISMATCH", self.mismatch_caught))
        return checks

    @property
    def ok(self) -> bool:
        return all(passed for _, passed in self.checks)

    def to_dict(self) -> dict:
        return {"decisions": self.decisions, "windows": self.windows, "offline": self.offline,
                "champion_before": self.champion_before, "champion_after": self.champion_after,
                "deployed_after": self.deployed_after, "checks": self.checks, "ok": self.ok, "phases": self.phases,
                "speed": [row.to_dict() for row in self.speed]}


def engine_configs(original: DraftopsConfig, updated: DraftopsConfig, engine: ServedEngine, out: Path
                   ) -> tuple[DraftopsConfig, DraftopsConfig]:
    """Both configs pointed at the engine: its metrics, its reload endpoint, the deploy folder under `out`."""
    def wire(cfg: DraftopsConfig) -> DraftopsConfig:
        deploy = cfg.monitor.deploy.model_copy(update={
            "enabled": True, "dir": str(out / "deploy"), "format": "gguf", "reload_url": engine.reload_url,
            "reload_command": [], "gguf_vocabulary": cfg.monitor.deploy.gguf_vocabulary or original.target})
        return cfg.model_copy(update={"monitor": cfg.monitor.model_copy(update={
            "server_metrics_url": engine.metrics_url, "deploy": deploy})})
    return wire(original), wire(updated)


def replayed_prompts(cfg: DraftopsConfig) -> list[list[int]]:
    """The held-out prompts the checks measure (the most recent monitor.heldout_requests), as token ids."""
    requests = heldout_by_recency(cfg.traffic)[-cfg.monitor.heldout_requests:]
    tokenizer = AutoTokenizer.from_pretrained(locate(cfg.target).path)
    return encode_prompts(requests, tokenizer, cfg.traffic.max_prompt_tokens)[0]


def _distilled(cfg: DraftopsConfig) -> str:
    return str(run_distill(cfg).version)


def run_serve_demo(cfg: DraftopsConfig, out: str | Path = DEFAULT_OUT, *, champion: Callable[[DraftopsConfig], str]
                   | None = None, retrain: Callable[[DraftopsConfig], str] | None = None,
                   rehearse_mismatch: bool = False, speed: bool = True, per_window: int = 6,
                   threads: int | None = None, echo=print) -> ServeDemoResult:
    """The phases of the module docstring. `champion(cfg)` and `retrain(cfg)` make and register a draft (default:
    distill; a test passes cheaper ones); `threads`: llama-server's (default: every core). Returns the result whose
    `checks` the summary prints."""
    name, out = cfg.tracking.registered_model, Path(out).resolve()
    start_afresh(cfg, out, OWNED_DIRS, "configs/serve_demo.yaml")
    original, updated = demo_configs(cfg, out, str(out / "target-updated"))
    setup_mlflow(original)
    claim_model(name)
    result = ServeDemoResult()
    phase = Phases("serve-demo", 6 + rehearse_mismatch + speed, echo, result.phases)
    served_target = target_gguf(original.target)
    version = phase(f"distill a champion against the original target ({original.target})",
                    lambda: (champion or _distilled)(original))
    result.champion_before = version
    with ServedEngine(served_target, draft_max=original.decode.gamma, threads=threads,
                      log_dir=out / "engine") as engine:
        original, updated = engine_configs(original, updated, engine, out)
        save_config(original, out / "config-original-target.yaml")
        save_config(updated, out / "config-updated-target.yaml")
        replayer = Replayer(engine, replayed_prompts(original), original.decode.max_new_tokens, per_window)
        check = partial(_engine_check, result, replayer, echo)
        deployed = phase(f"llama-server on {served_target.name}; deploy version {version} to it",
                         lambda: deploy_champion(original))
        echo(deployed.summary())
        phase("check, original target (expect OK: the deployed draft confirmed in the engine)",
              lambda: check(original, f"original target, version {version}"))
        phase("target update (LoRA, merged), written as GGUF and rolled out to the engine",
              lambda: _roll_out_update(original, engine, served_target, out, echo))
        drift = phase("check, updated target (expect DRIFT from the engine's counters; retrain, gate, promote, "
                      "deploy)", lambda: check(updated, f"updated target, version {version}",
                                               **({"retrain": retrain} if retrain else {})))
        result.drift_from_engine = bool(drift.engine and drift.engine.test and drift.engine.test.alarm)
        result.champion_after = registry.champion(name).version
        current = DeployFolder.of(updated).linked(CURRENT)
        result.deployed_after = current.version if current else None
        after = phase("post-deploy check (expect OK: the new draft confirmed, acceptance recovered)",
                      lambda: check(updated, f"updated target, version {result.champion_after}"))
        result.confirmed = bool(after.engine and after.engine.post_deploy and after.engine.test is not None
                                and not after.engine.mismatch)
        result.recovered = after.engine.recovered if after.engine else None
        if rehearse_mismatch:
            result.mismatch_caught = phase("a wrong deployment: the engine restarted with the old draft's file "
                                           "(expect DEPLOY_MISMATCH)", lambda: _rehearse(updated, engine, check))
        if speed:
            result.speed = phase("llama.cpp with the draft against llama.cpp alone (tokens/s)",
                                 lambda: _speed(updated, engine, replayer.prompts, out))
    _summary(result, updated, phase, echo)
    return result


def _engine_check(result: ServeDemoResult, replayer: Replayer, echo, cfg: DraftopsConfig, label: str, **options):
    """A check whose engine windows are the replayed prompts: its decision and the engine's acceptance per window
    (beside the draft's offline figure) recorded under `label`."""
    report = locked_check(cfg, echo, wait=replayer.window, **options)
    result.decisions.append(decision_label(report))
    if report.engine is not None:
        result.windows[label] = [w.acceptance for w in report.engine.windows]
        result.offline[label] = report.engine.expected
    return report


def _roll_out_update(cfg: DraftopsConfig, engine: ServedEngine, served_target: Path, out: Path, echo) -> None:
    """The target update (`run_finetune`) written as the served GGUF, the engine restarted on it."""
    finetuned = run_finetune(cfg)
    served = write_target_gguf(finetuned.path, served_target, out / "target-updated.gguf")
    engine.restart(target=served)
    echo(f"[serve-demo] updated target {finetuned.path} -> {served.name}, served by llama-server")


def _rehearse(cfg: DraftopsConfig, engine: ServedEngine, check) -> bool:
    """Deploy the champion again while the engine is pinned to the previous version's file; the check must fail."""
    previous = DeployFolder.of(cfg).linked(PREVIOUS)
    engine.pin_draft = previous.file
    try:
        deploy_champion(cfg, force=True)
        report = check(cfg, "wrong deployment")
    finally:
        engine.pin_draft = None
    return report.decision.status is Status.DEPLOY_MISMATCH and report.exit_code == 4


def _speed(cfg: DraftopsConfig, engine: ServedEngine, prompts: list[list[int]], out: Path) -> list:
    """Settings around the deployed draft on the served target (`monitor.fleet.speed.settings_for`): f16 and Q8_0, γ,
    2 and 1 tokens, a minimum draft probability."""
    deployed = DeployFolder.of(cfg).linked(CURRENT)
    q8 = export_format(draft_source(deployed.source), "gguf", out / "speed" / "draft-q8_0", force=True,
                       vocabulary=target_gguf(cfg.monitor.deploy.gguf_vocabulary or cfg.target), gguf_dtype="q8_0")
    settings = settings_for(deployed.file, next(q8.glob("*.gguf")), cfg.decode.gamma, synthetic=False)
    engine.__exit__(None, None, None)  # the measured servers alone on the CPU
    return measure_speed(engine.target, settings, prompts[:SPEED_PROMPTS], cfg.decode.max_new_tokens,
                         threads=engine.threads, log_dir=out / "speed")


def _summary(result: ServeDemoResult, cfg: DraftopsConfig, phase: Phases, echo) -> None:
    import mlflow

    echo("\n[serve-demo] engine acceptance per window (llama-server's counters: accepted / drafted tokens):")
    for label, values in result.windows.items():
        offline = result.offline.get(label)
        echo(f"  {label:<36} {' '.join(f'{v:.3f}' for v in values):<24} offline, as the engine counts: "
             f"{'n/a' if offline is None else f'{offline:.3f}'}")
    echo(f"[serve-demo] decisions: {' -> '.join(result.decisions)}; champion {result.champion_before} -> "
         f"{result.champion_after}; deployed {result.deployed_after}")
    echo("[serve-demo] time per phase:")
    for line in phase.summary():
        echo(line)
    if result.speed:
        echo("[serve-demo] llama.cpp with the draft vs alone (same server binary, target and prompts):")
        for line in speed_table(result.speed):
            echo("  " + line)
    for title, passed in result.checks:
        echo(f"  [{'x' if passed else ' '}] {title}")
    with start_run(cfg, "monitor", run_name="serve-demo", tags={
            M.MONITOR_DECISION_TAG: "SERVE-DEMO", M.REGISTERED_MODEL_TAG: cfg.tracking.registered_model}):
        for label, values in result.windows.items():
            for step, value in enumerate(values):
                mlflow.log_metric(f"serve_demo/window_acceptance/{label.replace(',', '').replace(' ', '_')}", value,
                                  step=step)
        mlflow.log_dict(result.to_dict(), "serve_demo/summary.json")
    echo(f"[serve-demo] {'done' if result.ok else 'FINISHED WITH FAILED CHECKS'}; MLflow: {tracking_uri(cfg)} "
         f"(experiments draftops-distill, draftops-target, draftops-monitor); summary {json.dumps(result.ok)}")

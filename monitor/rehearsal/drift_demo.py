"""`make drift-demo`: a target update found and repaired end to end, with small budgets (configs/drift_demo.yaml).

1. distill a champion against the original target (registered: version 1, alias champion);
2. monitor check: OK, baseline recorded;
3. `target finetune`: an updated target (LoRA, another style, merged);
4. monitor check against the updated target, with retraining on: DRIFT (cause: target changed), a challenger
   distilled warm from the champion (distill.init=checkpoint), gated and promoted;
5. monitor check again: OK.

The work per phase with configs/drift_demo.yaml: 1. 291 target responses and 72 training steps; 2. 99 held-out
responses and one acceptance pass; 3. 30 LoRA steps (responses from the cache); 4. new responses and a pass, the
re-distillation, the gate's two passes; 5. one pass. Each phase's time is printed; a whole run's is in
docs/results.md."""
# Everything goes under `--out` (configs, distill jobs, the updated target, monitor state) and into the configured
# MLflow store. The demo owns its registered model (not the production one) and its folders, and starts them afresh:
# it deletes only what it created itself (a folder it marked with `OUT_MARKER`, a registered model it tagged with
# `pipeline.metrics.DRIFT_DEMO_TAG`) and refuses anything else. Target responses stay cached in $DRAFTOPS_HOME, so a
# second run generates only what changed. The last line it prints is the `draftops monitor check` command that
# re-checks the state it leaves.
#
from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from distill.train import run_distill
from monitor.check.run import run_check
from monitor.rehearsal.target_update import run_finetune
from monitor.service.scheduler import check_lock
from pipeline import metrics as M
from pipeline import registry
from pipeline.config import DraftopsConfig, TrackingConfig, save_config
from pipeline.tracking import setup_mlflow, tracking_uri

DEFAULT_OUT = "outputs/drift-demo"
PRODUCTION_MODEL = TrackingConfig().registered_model
OWNED_DIRS = ("distill", "monitor", "target-updated")  # under --out, emptied by every run
OUT_MARKER = ".draftops-drift-demo"  # written into --out when the demo creates it or finds it empty
ACCEPTANCE_TOLERANCE = 0.02  # the new champion on the new target vs the old champion on the old target


@dataclass
class DemoResult:
    decisions: list[str] = field(default_factory=list)  # "OK", "DRIFT(target_changed)", ...
    versions: list[str] = field(default_factory=list)  # registered draft versions, oldest first
    champion_before: str | None = None
    champion_after: str | None = None
    acceptance_before: float | None = None  # old champion, old target (the first baseline)
    acceptance_drop: float | None = None  # old champion, old -> new target (paired test)
    acceptance_after: float | None = None  # new champion, new target (the last check)
    phases: list[tuple[str, float]] = field(default_factory=list)
    recheck_command: str = ""

    @property
    def checks(self) -> list[tuple[str, bool]]:
        return [
            ("decisions OK -> DRIFT(target_changed) -> OK", self.decisions == ["OK", "DRIFT(target_changed)", "OK"]),
            ("two draft versions registered", len(self.versions) == 2),
            ("champion alias moved to the new version",
             self.champion_after is not None and self.champion_after != self.champion_before
             and self.champion_after == (self.versions[-1] if self.versions else None)),
            (f"new champion on the new target within {ACCEPTANCE_TOLERANCE * 100:.0f} points of (or above) the old "
             "one on the old target",
             None not in (self.acceptance_before, self.acceptance_after)
             and self.acceptance_after >= self.acceptance_before - ACCEPTANCE_TOLERANCE),
        ]

    @property
    def ok(self) -> bool:
        return all(passed for _, passed in self.checks)


def demo_configs(cfg: DraftopsConfig, out: Path, updated_target: str) -> tuple[DraftopsConfig, DraftopsConfig]:
    """(original-target config, updated-target config): outputs under `out`; the second retrains on DRIFT, warm
    from whichever draft is champion then."""
    name = cfg.tracking.registered_model
    original = cfg.model_copy(update={
        "distill": cfg.distill.model_copy(update={"output_dir": str(out / "distill"), "register_model": True}),
        "monitor": cfg.monitor.model_copy(update={"state_dir": str(out / "monitor")}),
        "target_update": cfg.target_update.model_copy(update={"output_dir": updated_target}),
    })
    updated = original.model_copy(update={
        "target": updated_target,
        "distill": original.distill.model_copy(update={"init": "checkpoint",
                                                       "init_checkpoint": registry.alias_uri(name, M.CHAMPION)}),
        "monitor": original.monitor.model_copy(update={"retrain": True}),
    })
    return original, updated


def draftops_executable() -> str:
    """`draftops` when it is on PATH, else this environment's script (e.g. .venv/bin/draftops), so that the printed
    command runs as it is."""
    script = Path(sys.executable).parent / "draftops"
    on_path = shutil.which("draftops")
    if on_path is not None and (not script.exists() or Path(on_path).resolve() == script.resolve()):
        return "draftops"
    return os.path.relpath(script) if script.exists() else "draftops"


def claim_out(out: Path) -> None:
    """Make `out` the demo's folder: created (or found empty) and marked, or marked by an earlier demo. Any other
    folder is refused, since the demo empties its subfolders."""
    if out.exists() and not (out / OUT_MARKER).exists() and any(out.iterdir()):
        raise ValueError(f"{out} holds files the drift demo did not create (no {OUT_MARKER}); it empties its "
                         "subfolders, so give it a new or empty folder (--out)")
    out.mkdir(parents=True, exist_ok=True)
    (out / OUT_MARKER).write_text("created by `draftops monitor demo`; its subfolders are emptied by every run\n")


def claim_model(name: str) -> bool:
    """Start registered model `name` afresh for the demo: delete it if an earlier demo created it (True), refuse it
    if anything else did, then create it tagged as the demo's."""
    tags = registry.model_tags(name)
    if tags is not None and tags.get(M.DRIFT_DEMO_TAG) != "true":
        raise ValueError(f"registered model '{name}' was not created by the drift demo; the demo deletes its model "
                         "on every run, so give it a name of its own (tracking.registered_model)")
    if tags is not None:
        registry.delete_model(name)
    registry.create_model(name, tags={M.DRIFT_DEMO_TAG: "true"})
    return tags is not None


def start_afresh(cfg: DraftopsConfig, out: Path, owned: Sequence[str], config_file: str) -> None:
    """Refuse the production registered model; claim `out` (`claim_out`) and empty the folders the demo owns in it: a
    fresh demo, no resumed distill job, no earlier monitor state."""
    if cfg.tracking.registered_model == PRODUCTION_MODEL:
        raise ValueError(f"the demo starts its registered model afresh: give it a name of its own, not "
                         f"'{PRODUCTION_MODEL}' ({config_file}: tracking.registered_model)")
    claim_out(out)
    for folder in owned:
        shutil.rmtree(out / folder, ignore_errors=True)


class Phases:
    """A demo's numbered phases: `phases(title, fn)` announces the phase, runs `fn` and prints its time and the
    total so far; `times` holds each phase's (title, seconds)."""

    def __init__(self, tag: str, count: int, echo, times: list[tuple[str, float]]):
        self.tag, self.count, self.echo, self.times = tag, count, echo, times
        self.started = time.perf_counter()

    def __call__(self, title: str, fn):
        self.echo(f"\n[{self.tag}] phase {len(self.times) + 1}/{self.count}: {title}")
        began = time.perf_counter()
        value = fn()
        self.times.append((title, time.perf_counter() - began))
        self.echo(f"[{self.tag}] phase {len(self.times)}/{self.count} done in {self.times[-1][1]:.0f}s "
                  f"(total {self.elapsed():.0f}s)")
        return value

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def summary(self) -> list[str]:
        """The time of each phase, then the total."""
        return [f"  {seconds:7.0f}s  {title}" for title, seconds in self.times] + [f"  {self.elapsed():7.0f}s  total"]


def locked_check(cfg: DraftopsConfig, echo, **options):
    """A monitor check under the registered model's check lock (`run_check` with `options`), its summary printed."""
    with check_lock(cfg):
        report = run_check(cfg, **options)
    echo(report.summary())
    return report


def decision_label(report) -> str:
    """A check's decision as the demos list it: `OK`, `DRIFT(target_changed)`, ..."""
    d = report.decision
    return d.status.value + (f"({d.cause.value})" if d.cause else "")


def run_demo(cfg: DraftopsConfig, out: str | Path = DEFAULT_OUT, *, echo=print) -> DemoResult:
    """The five phases; prints each phase's outcome and time, the checks, and the re-check command last."""
    name, out = cfg.tracking.registered_model, Path(out)
    start_afresh(cfg, out, OWNED_DIRS, "configs/drift_demo.yaml")
    original, updated = demo_configs(cfg, out, str(out / OWNED_DIRS[2]))
    original_path = save_config(original, out / "config-original-target.yaml")
    updated_path = save_config(updated, out / "config-updated-target.yaml")
    result = DemoResult(recheck_command=f"{draftops_executable()} monitor check --config {updated_path}")
    setup_mlflow(original)
    if claim_model(name):
        echo(f"[demo] registered model '{name}' from an earlier demo at {tracking_uri(original)}: deleted, starting "
             "afresh")
    echo(f"[demo] configs: {original_path} (original target), {updated_path} (updated target)")
    phase = Phases("demo", 5, echo, result.phases)

    def check(config: DraftopsConfig):
        report = locked_check(config, echo)
        echo("  time: " + "  ".join(f"{k} {v:.0f}s" for k, v in report.timings.items()))
        result.decisions.append(decision_label(report))
        return report

    distilled = phase(f"distill a champion against the original target ({original.target})",
                      lambda: run_distill(original))
    result.champion_before = registry.champion(name).version
    echo(f"[demo] {name} version {distilled.version} ({distilled.alias})")
    first = phase("monitor check, original target (expect OK, baseline recorded)", lambda: check(original))
    result.acceptance_before = first.current_acceptance
    finetuned = phase(f"target finetune ({original.target_update.style} style, LoRA, merged)",
                      lambda: run_finetune(original))
    echo(f"[demo] updated target {finetuned.path}: fingerprint {finetuned.base_fingerprint} -> "
         f"{finetuned.fingerprint}, LoRA loss {finetuned.losses[0]:.3f} -> {finetuned.losses[-1]:.3f}")
    second = phase("monitor check, updated target, retrain on (expect DRIFT: target changed; retrain, gate, "
                   "promote)", lambda: check(updated))
    if second.acceptance is not None and second.acceptance.paired is not None:
        result.acceptance_drop = second.acceptance.paired.drop
    third = phase("monitor check again (expect OK)", lambda: check(updated))
    result.acceptance_after = third.current_acceptance
    result.champion_after = registry.champion(name).version
    result.versions = registry.version_numbers(name)
    _print_outcome(result, phase, name, tracking_uri(original), echo)
    return result


def _print_outcome(result: DemoResult, phase: Phases, name: str, uri: str, echo) -> None:
    echo("\n[demo] time per phase:")
    for line in phase.summary():
        echo(line)
    echo(f"\n[demo] decisions: {' -> '.join(result.decisions)}; {name}@{M.CHAMPION}: version "
         f"{result.champion_before} -> {result.champion_after}; versions {', '.join(result.versions)} in {uri}")
    fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    echo(f"[demo] acceptance: old champion on the old target {fmt(result.acceptance_before)}; drop on the updated "
         f"target {fmt(result.acceptance_drop)}; new champion on the updated target {fmt(result.acceptance_after)}")
    for title, passed in result.checks:
        echo(f"  [{'x' if passed else ' '}] {title}")
    echo(f"[demo] {'done' if result.ok else 'FINISHED WITH FAILED CHECKS'}; re-check the state it leaves with:")
    echo(result.recheck_command)

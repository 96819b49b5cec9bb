"""kill -9 at seeded write boundaries of a distill job and of a monitor check that retrains and promotes, then run
the same command again: the registry stays consistent after the kill and after the re-run, nothing is registered
twice, and the re-run ends where an uninterrupted run ends (for distill: the same weights).

The kill points are drawn (seeded) from the boundaries an uninterrupted run crosses (tests.faults.killpoints counts
them): between every two registry calls, plus a seeded sample of every other kind of write (renames, deletions,
file writes, tracking calls; `Path.write_text` also torn in half). Tiny models; minutes on 2 cores. Each point's
outcome (what the kill left in the registry, the re-run's exit code) goes to test-artifacts/fault-injection-*.json.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from safetensors.torch import load_file

from pipeline import metrics as M
from pipeline.config import save_config
from pipeline.sources import save_checkpoint
from tests.conftest import make_tiny_model, make_tokenizer
from tests.distill.tiny_job import tiny_config

pytestmark = pytest.mark.faults
REPO = Path(__file__).resolve().parents[2]
NAME = "draftops-draft"
SEED = 20261130
DISTILL_POINTS, CHECK_POINTS = 12, 12
# A champion distilled from target A that is nearly A itself (both layers, full vocabulary, a tiny learning rate);
# target B is another random model, so the check finds a drift, and the challenger (B's layers) is promoted.
SETTINGS = ("cpu_linear=torch", "distill.init_layers=[0,1]", "distill.draft_vocab_size=0",
            "distill.learning_rate=0.0001",
            "distill.max_steps=4", "decode.temperature=1.0", "monitor.heldout_requests=12", "monitor.n_bootstrap=200",
            "monitor.break_even_alpha=0", "monitor.retrain_init=config")


@dataclass(frozen=True)
class KillPoint:
    boundary: str
    nth: int
    when: str

    def __str__(self) -> str:
        return f"{self.boundary}:{self.nth}:{self.when}"


def draftops(folder: Path, args: list[str], *, instrument: list[str] | None = None) -> subprocess.CompletedProcess:
    prefix = ["-m", "tests.faults.killpoints", *instrument, "--"] if instrument else ["-m", "pipeline.cli"]
    return subprocess.run([sys.executable, *prefix, *args], cwd=folder, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO), "DRAFTOPS_HOME": str(folder / "home"),
                               "MLFLOW_TRACKING_URI": f"sqlite:///{folder}/mlflow.db"})


def config_in(folder: Path, world: Path) -> Path:
    """A config whose every writable path lies in `folder`; targets and traffic are the world's (read only)."""
    # the generation and training precisions pinned: `auto` times the CPU in each run's own home, and the runs
    # compared here must produce the same weights bit for bit
    cfg = tiny_config(world, *SETTINGS, f"tracking.uri=sqlite:///{folder}/mlflow.db",
                      f"distill.output_dir={folder}/out", f"monitor.state_dir={folder}/state",
                      "distill.generation_dtype=float32", "distill.mixed_precision=no")
    return save_config(cfg, folder / "cfg.yaml")


def kill_points(timeline: list[str], n: int, rng: random.Random) -> list[KillPoint]:
    """Before the first registry call and after each one (before a call is after the previous one); then, boundary
    by boundary in turn, so that every kind of write is tried, a seeded crossing of each, until there are n points."""
    seen: dict[str, int] = {}
    registry, others = [], {}
    for name in timeline:
        seen[name] = seen.get(name, 0) + 1
        (registry.append((name, seen[name])) if name.startswith("registry.")
         else others.setdefault(name, []).append(seen[name]))
    points = [KillPoint(*registry[0], "before")] + [KillPoint(name, nth, "after") for name, nth in registry]
    others = {name: rng.sample(nths, len(nths)) for name, nths in sorted(others.items())}
    while len(points) < n and any(others.values()):
        for name, nths in others.items():
            if nths and len(points) < n:
                whens = ("before", "after", "torn") if name == "Path.write_text" else ("before", "after")
                points.append(KillPoint(name, nths.pop(), rng.choice(whens)))
    return points


def registry_state(folder: Path) -> dict:
    client = MlflowClient(tracking_uri=f"sqlite:///{folder}/mlflow.db", registry_uri=f"sqlite:///{folder}/mlflow.db")
    models = client.search_registered_models()
    if not models:
        return {"versions": {}, "aliases": {}}
    versions = {str(v.version): dict(v.tags) for v in client.search_model_versions(f"name='{NAME}'")}
    aliases = {alias: str(version) for alias, version in client.get_registered_model(NAME).aliases.items()}
    return {"versions": versions, "aliases": aliases}


def assert_consistent(state: dict) -> None:
    """Aliases point at existing versions, a challenger is never the champion, a champion has its baseline unless
    it is the first one (whose baseline the first check records), and no distill job is registered twice."""
    aliases, versions = state["aliases"], state["versions"]
    assert set(aliases.values()) <= set(versions)
    assert aliases.get(M.CHALLENGER) is None or aliases[M.CHALLENGER] != aliases.get(M.CHAMPION)
    if M.CHAMPION in aliases and aliases[M.CHAMPION] != "1":
        assert M.BASELINE_RUN_TAG in versions[aliases[M.CHAMPION]]
    jobs = [tags.get(M.DISTILL_JOB_TAG) for tags in versions.values()]
    assert len(jobs) == len(set(jobs)), f"a distill job registered twice: {versions}"


def summary(state: dict) -> str:
    """`1:champion 2:-` style: each version and its aliases."""
    held = {v: sorted(a for a, w in state["aliases"].items() if w == v) for v in state["versions"]}
    return " ".join(f"{v}:{','.join(a) or '-'}" for v, a in sorted(held.items(), key=lambda x: int(x[0]))) or "empty"


def write_outcomes(name: str, outcomes: list[dict]) -> None:
    (REPO / "test-artifacts").mkdir(exist_ok=True)
    (REPO / "test-artifacts" / f"fault-injection-{name}.json").write_text(json.dumps(outcomes, indent=1))


def weights(folder: Path) -> dict[str, torch.Tensor]:
    """The exported weights of the one distill job in `folder`."""
    (path,) = (folder / "out").glob("*/result.json")
    result = json.loads(path.read_text())
    return load_file(Path(result["export_dir"]) / "model.safetensors")


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    world = tmp_path_factory.mktemp("world")
    tokenizer = make_tokenizer(extra_words=40)
    save_checkpoint(make_tiny_model(len(tokenizer), seed=5), tokenizer, world / "target_b")
    tiny_config(world)  # writes target A and the traffic
    return world


@pytest.fixture(scope="module")
def reference(world, tmp_path_factory) -> dict:
    """Uninterrupted runs: a distill job (its boundaries counted), a first check (the baseline), then a check on
    target B that retrains and promotes (its boundaries counted). `before_check` is the state the killed checks
    start from."""
    folder = tmp_path_factory.mktemp("reference")
    cfg = config_in(folder, world)
    distilled = draftops(folder, ["distill", "--config", str(cfg)], instrument=["count", str(folder / "d.json")])
    assert distilled.returncode == 0, distilled.stderr[-4000:]
    distilled_weights = weights(folder)  # before the retrain below adds a second job to out/
    first = draftops(folder, ["monitor", "check", "--config", str(cfg)])
    assert first.returncode == 0, first.stderr[-4000:]
    before_check = tmp_path_factory.mktemp("before-check")
    for part in ("mlflow.db", "home", "state", "out"):
        if not (folder / part).exists():
            continue
        if (folder / part).is_dir():
            shutil.copytree(folder / part, before_check / part, symlinks=True)  # out/latest stays a link
        else:
            shutil.copy(folder / part, before_check / part)
    drift = check_on_b(folder, world, instrument=["count", str(folder / "c.json")])
    assert drift.returncode == 3 and "-> PROMOTED" in drift.stdout, drift.stdout[-3000:] + drift.stderr[-3000:]
    state = registry_state(folder)
    assert state["aliases"] == {M.CHAMPION: "2", M.PREVIOUS_CHAMPION: "1"}
    return {"folder": folder, "distilled_weights": distilled_weights,
            "distill_timeline": json.loads((folder / "d.json").read_text()),
            "check_timeline": json.loads((folder / "c.json").read_text()), "state": state,
            "before_check": before_check}


def check_on_b(folder: Path, world: Path, instrument: list[str] | None = None) -> subprocess.CompletedProcess:
    return draftops(folder, ["monitor", "check", "--config", str(folder / "cfg.yaml"), f"target={world / 'target_b'}",
                             "monitor.retrain=true"], instrument=instrument)


def test_kill_9_anywhere_in_distill_then_rerun(world, reference, tmp_path):
    points = kill_points(reference["distill_timeline"], DISTILL_POINTS, random.Random(SEED))
    outcomes = []
    for i, point in enumerate(points):
        folder = tmp_path / f"distill-{i}"
        folder.mkdir()
        cfg = config_in(folder, world)
        killed = draftops(folder, ["distill", "--config", str(cfg)], instrument=["kill", str(point)])
        assert killed.returncode == -9, f"{point}: the kill point was not reached\n{killed.stderr[-3000:]}"
        left = registry_state(folder)
        assert_consistent(left)
        again = draftops(folder, ["distill", "--config", str(cfg)])
        assert again.returncode == 0, f"{point}: the re-run failed\n{again.stderr[-4000:]}"
        state = registry_state(folder)
        assert_consistent(state)
        assert list(state["versions"]) == ["1"] and state["aliases"] == {M.CHAMPION: "1"}, (point, state)
        expected, got = reference["distilled_weights"], weights(folder)
        assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected), point
        outcomes.append({"point": str(point), "left": summary(left), "rerun_exit": again.returncode,
                         "rerun_trained": "nothing trained again" not in again.stdout})
    write_outcomes("distill", outcomes)
    assert len(outcomes) == len(points) >= DISTILL_POINTS


def test_kill_9_anywhere_in_a_check_that_retrains_and_promotes_then_rerun(world, reference, tmp_path):
    points = kill_points(reference["check_timeline"], CHECK_POINTS, random.Random(SEED + 1))
    outcomes = []
    for i, point in enumerate(points):
        folder = tmp_path / f"check-{i}"
        shutil.copytree(reference["before_check"], folder, symlinks=True)
        config_in(folder, world)
        killed = check_on_b(folder, world, instrument=["kill", str(point)])
        assert killed.returncode == -9, f"{point}: the kill point was not reached\n{killed.stderr[-3000:]}"
        left = registry_state(folder)
        assert_consistent(left)
        again = check_on_b(folder, world)
        assert again.returncode in (0, 3), f"{point}: the re-run failed\n{again.stderr[-4000:]}"
        state = registry_state(folder)
        assert_consistent(state)
        assert state["aliases"] == reference["state"]["aliases"], (point, state)
        assert sorted(state["versions"]) == ["1", "2"], (point, state)
        outcomes.append({"point": str(point), "left": summary(left), "rerun_exit": again.returncode,
                         "rerun_promoted": "-> PROMOTED" in again.stdout})
    write_outcomes("check", outcomes)
    assert len(outcomes) == len(points) >= CHECK_POINTS

"""kill -9 during `draftops monitor deploy` (tests/faults/killpoints.py) leaves `current` on a whole deployment, the old
one or the new one, and the same command run again finishes the deploy: new version current, old one previous and
whole, the engine reloaded with the new one.

Version 1 is deployed, version 2 promoted; then the deploy of version 2 is run once uninterrupted (its write
boundaries counted) and, from the same starting state, killed at seeded boundaries: every rename (the folder swap of the
export, the manifest, the two link flips, the state file), a torn file write and a deletion. Tiny drafts, hf format.
"""
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import mlflow

from monitor.release.layout import CURRENT, PREVIOUS, DeployFolder
from monitor.release.rollout import deploy_champion
from pipeline import registry
from pipeline.config import load_config
from tests.monitor.check.test_run import write_traffic
from tests.monitor.deploy_world import NAME, calls_of, register_tiny_draft, write_config

REPO = Path(__file__).resolve().parents[2]
SEED = 20261204
POINTS = 5


def draftops(work: Path, args: list[str], instrument: list[str] | None = None) -> subprocess.CompletedProcess:
    prefix = ["-m", "tests.faults.killpoints", *instrument, "--"] if instrument else ["-m", "pipeline.cli"]
    return subprocess.run([sys.executable, *prefix, *args], cwd=work, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def kill_points(timeline: list[str], rng: random.Random) -> list[str]:
    """Renames before or after (drawn), always with the last one (deploy.json saying the reload was done, after the
    flip), then a torn write and a deletion, up to POINTS."""
    seen: dict[str, int] = {}
    crossings = []
    for name in timeline:
        seen[name] = seen.get(name, 0) + 1
        crossings.append((name, seen[name]))
    renames = [f"{n}:{i}:{rng.choice(('before', 'after'))}" for n, i in crossings if n == "os.replace"]
    torn = [f"{n}:{i}:torn" for n, i in crossings if n == "Path.write_text"]
    deletions = [f"{n}:{i}:after" for n, i in crossings if n == "shutil.rmtree"]
    last = renames[-1].rsplit(":", 1)[0] + ":before"
    points = [last] + rng.sample(renames[:-1], min(len(renames) - 1, POINTS - 3)) + rng.sample(torn, 1)
    return points + rng.sample(deletions, 1)


def test_kill_9_during_deploy_leaves_the_old_or_the_new_deployment_whole(tmp_path, _migrated_mlflow_db, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # MLflow's artifacts and draftops' caches under work/, restored before every kill
    monkeypatch.setenv("DRAFTOPS_HOME", str(work / "home"))
    shutil.copy(_migrated_mlflow_db, work / "mlflow.db")
    uri = f"sqlite:///{work / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    write_traffic(work / "traffic.jsonl", 0, 20)
    register_tiny_draft(work / "drafts", seed=1)
    register_tiny_draft(work / "drafts", seed=2)
    config = write_config(work, uri, work / "traffic.jsonl")
    assert deploy_champion(load_config(config)).reloaded
    registry.promote(NAME, "2")
    start = tmp_path / "start"
    shutil.copytree(work, start, symlinks=True)
    deploy_root, command = work / "deploy", ["monitor", "deploy", "--config", str(config)]

    counted = draftops(work, command, ["count", str(tmp_path / "timeline.json")])
    assert counted.returncode == 0, counted.stderr[-3000:]
    timeline = json.loads((tmp_path / "timeline.json").read_text())
    assert timeline.count("os.replace") >= 5  # export swap, manifest, previous, current, state (twice)

    outcomes = []
    for point in kill_points(timeline, random.Random(SEED)):
        shutil.rmtree(work)
        shutil.copytree(start, work, symlinks=True)
        killed = draftops(work, command, ["kill", point])
        assert killed.returncode == -9, f"{point}: the kill point was not reached\n{killed.stderr[-3000:]}"
        current, previous = DeployFolder(deploy_root).linked(CURRENT), DeployFolder(deploy_root).linked(PREVIOUS)
        assert current is not None and current.version in ("1", "2"), point  # whole: every file as its manifest
        assert previous is None or previous.version == "1", point
        left = current.version
        again = draftops(work, command)
        assert again.returncode == 0, f"{point}: the re-run failed\n{again.stderr[-3000:]}"
        current, previous = DeployFolder(deploy_root).linked(CURRENT), DeployFolder(deploy_root).linked(PREVIOUS)
        assert (current.version, previous.version) == ("2", "1"), point
        state = DeployFolder(deploy_root).read_state()
        assert state["version"] == "2" and state["reloaded"] and state["folder"] == current.folder.name, point
        reloads = [call[0] for call in calls_of(work / "reloads.txt")]
        assert reloads[0] == "1" and reloads[-1] == "2", (point, reloads)
        outcomes.append(f"{point}: current left on version {left}")
    (REPO / "test-artifacts").mkdir(exist_ok=True)
    (REPO / "test-artifacts" / "deploy-kill.json").write_text(json.dumps(outcomes, indent=1))
    assert len(outcomes) == POINTS, outcomes
    assert {o.rsplit(" ", 1)[1] for o in outcomes} == {"1", "2"}, outcomes  # the kills fell before and after the flip

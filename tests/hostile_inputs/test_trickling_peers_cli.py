"""The commands an operator runs, each as a process of its own, against a peer that trickles its answer a byte a
second: the tracking server's /health or its REST API (monitor check, monitor serve, report, monitor rollback, eval),
Prometheus' API (monitor check, and one check of the service's loop), Alertmanager and a webhook (monitor rollback's
alert), a reload URL (monitor rollback with deploys on). Each request is cut at its deadline (DEADLINE s, set in the
config), the command ends with one line, exit 2 (an alert that fails never changes a command's exit code: it is one
logged line per target), and the registered model's lock is free afterwards: another command takes it at once.

Times are measured from the first trickled request (an interpreter's start on a loaded 2-core machine is not the
deadline's to bound): the peer sees the client hang up within CUT s, the command ends within EXIT s after it."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
import yaml
from mlflow import MlflowClient

from monitor.service.scheduler import run_scheduled_check
from pipeline import metrics as M
from pipeline import registry
from pipeline.locks import model_lock
from tests.conftest import WORDS, make_tiny_model, make_tokenizer
from tests.fake_peers import Trickler
from tests.hostile_inputs.test_tracking_hangs import one_line
from tests.monitor.deploy_world import register_tiny_draft

REPO = Path(__file__).resolve().parents[2]
NAME = "draftops-draft"
DEADLINE = 2  # tracking.http_timeout, monitor.server_timeout, monitor.alerts.deadline, monitor.deploy.reload_timeout
CUT = DEADLINE + 1.5  # a request's deadline, seen from the peer
EXIT = 60.0  # the rest of a command after its request was cut: the interpreter's exit alone took 17-19 s on a 2-core
# machine that a training job kept busy
CHECK = 300.0  # a tiny check after its Prometheus reading was cut: 146 s at a load of 20 on 2 cores (a hang: unbounded)
MLFLOW_KNOBS = ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_REGISTRY_URI")


def draftops(argv: list[str], cwd: Path, tracking_env: str) -> tuple[int, str, str, float]:
    """`draftops ARGV` in a fresh interpreter running this tree, MLFLOW_TRACKING_URI = `tracking_env`: (exit code,
    stdout, stderr, when it ended)."""
    env = {k: v for k, v in os.environ.items() if k not in MLFLOW_KNOBS}
    env.update(MLFLOW_TRACKING_URI=tracking_env, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", *argv], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=600)
    return out.returncode, out.stdout, out.stderr, time.monotonic()


def said_lines(err: str) -> list[str]:
    """stderr without progress bars and MLflow's INFO lines (an experiment created on a store's first run)."""
    return [line for line in err.strip().splitlines() if line.strip() and "%|" not in line
            and not re.match(r"\S+ \S+ INFO mlflow", line)]


def assert_in_time(peer: Trickler, ended: float, rest: float = EXIT) -> None:
    assert peer.cut_within() < CUT, peer.held
    assert ended - peer.held[0][0] < CUT + rest, ended - peer.held[0][0]


def assert_lock_free(uri: str) -> None:
    with model_lock(NAME, uri, timeout=0):  # raises ModelBusy while anyone holds it
        pass


TRACKED = {"monitor check": ["monitor", "check"], "monitor serve": ["monitor", "serve"], "report": ["report"],
           "monitor rollback": ["monitor", "rollback"], "eval": ["eval", "--draft", "TINY", "--target", "TINY"]}
SAID = {"/health": "does not answer (no whole answer from /health within {s} s (tracking.http_timeout))",
        "/api/": "answers /health but not its API within {s} s (tracking.http_timeout)"}


@pytest.mark.parametrize("path", SAID, ids=["health", "api"])
@pytest.mark.parametrize("command", TRACKED)
def test_a_trickling_tracking_server_ends_each_command_in_one_line(command, path, tmp_path):
    """`tracking.uri` names the trickling server and MLFLOW_TRACKING_URI another store: the line names the first."""
    argv = TRACKED[command]
    if "TINY" in argv:
        from tests.distill.tiny_job import write_target

        argv = [str(write_target(tmp_path / "target")) if word == "TINY" else word for word in argv]
    peer = Trickler(only=path)
    try:
        code, _, err, ended = draftops([*argv, f"tracking.uri={peer.url}", f"tracking.http_timeout={DEADLINE}"],
                                       tmp_path, f"sqlite:///{tmp_path}/other.db")
    finally:
        peer.close()
    line = one_line(err)
    said = f"the MLflow tracking server {peer.url} {SAID[path].format(s=DEADLINE)}"
    assert code == 2 and said in line and "sqlite" not in line, line
    assert_in_time(peer, ended)
    assert_lock_free(peer.url)


@pytest.fixture
def checked_world(tmp_path, mlflow_uri):
    """A tiny target registered as its own draft (champion), 40 logged requests, and `config(**monitor)`: the path of
    a config that checks it with those `monitor` settings."""
    from pipeline.sources import save_checkpoint

    tokenizer = make_tokenizer()
    target = save_checkpoint(make_tiny_model(len(tokenizer), seed=0), tokenizer, tmp_path / "target")
    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text("".join(json.dumps({"id": f"q{i}", "messages": [{"role": "user", "content": " ".join(
        WORDS[(i * 7 + k) % len(WORDS)] for k in range(3 + i % 5))}]}) + "\n" for i in range(40)))
    mlflow.set_experiment("draftops-distill")
    with mlflow.start_run():
        registry.register(target, NAME, tags={M.TARGET_FINGERPRINT_TAG: "any"}, description="test draft")

    def config(**monitor) -> Path:
        path = tmp_path / "cfg.yaml"
        path.write_text(yaml.safe_dump({
            "target": str(target), "device": "cpu", "cpu_linear": "torch",
            "traffic": {"path": str(traffic), "heldout_fraction": 0.5},
            "tracking": {"uri": mlflow_uri, "system_metrics": False}, "decode": {"max_new_tokens": 6, "gamma": 3},
            "monitor": {"heldout_requests": 8, "state_dir": str(tmp_path / "state"), "n_bootstrap": 200,
                        "break_even_alpha": 0.0, "scrape_interval_minutes": 0, "metrics_port": 0, **monitor}}))
        return path

    return config


def test_a_trickling_prometheus_makes_monitor_check_an_error_in_one_line(checked_world, mlflow_uri, tmp_path):
    peer = Trickler()
    try:
        config = checked_world(prometheus_url=peer.url, server_timeout=DEADLINE)
        code, out, err, ended = draftops(["monitor", "check", "--config", str(config)], tmp_path, mlflow_uri)
    finally:
        peer.close()
    assert code == 2 and "Traceback" not in err and out.startswith(f"ERROR: {NAME}@champion"), out + err[-3000:]
    reasons = [line.strip() for line in out.splitlines() if line.strip().startswith("reason:")]
    assert reasons == [f"reason: no serving replica could be read (Prometheus at {peer.url}: no whole answer within "
                       f"{DEADLINE} s (monitor.server_timeout))"], out
    assert out.count("no whole answer") == 1 and "  engines (prometheus): none read" in out, out  # said once
    assert_in_time(peer, ended, rest=CHECK)  # the check goes on without the engine's figures: a tiny one
    assert_lock_free(mlflow_uri)


def test_a_trickling_prometheus_makes_the_services_check_an_error(checked_world, mlflow_uri, caplog):
    peer = Trickler()
    try:
        config = checked_world(prometheus_url=peer.url, server_timeout=DEADLINE)
        code = run_scheduled_check(str(config))
        ended = time.monotonic()
    finally:
        peer.close()
    assert code == 2
    assert_in_time(peer, ended, rest=CHECK)
    assert_lock_free(mlflow_uri)


@pytest.fixture
def two_versions(mlflow_uri):
    """Versions 1 (previous-champion) and 2 (champion), sources that are never read."""
    client = MlflowClient()
    client.create_registered_model(NAME)
    for _ in range(2):
        client.create_model_version(NAME, source="file:///nonexistent")
    client.set_registered_model_alias(NAME, M.CHAMPION, "2")
    client.set_registered_model_alias(NAME, M.PREVIOUS_CHAMPION, "1")


def test_a_trickling_alertmanager_and_webhook_never_hold_a_rollback(two_versions, mlflow_uri, tmp_path):
    alertmanager, webhook = Trickler(), Trickler()
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump({"tracking": {"uri": mlflow_uri, "system_metrics": False}, "monitor": {
        "state_dir": str(tmp_path / "state"), "alerts": {"deadline": DEADLINE, "tries": 3, "targets": [
            {"kind": "alertmanager", "url": alertmanager.url}, {"kind": "webhook", "url": webhook.url}]}}}))
    try:
        code, out, err, ended = draftops(["monitor", "rollback", "--config", str(config)], tmp_path, mlflow_uri)
    finally:
        alertmanager.close()
        webhook.close()
    assert code == 0 and out.strip() == f"{NAME}@champion -> version 1", out + err  # done; only the alert failed
    lines = said_lines(err)
    assert len(lines) == 2 and "Traceback" not in err, err[-3000:]
    for kind, peer, line in zip(("alertmanager", "webhook"), (alertmanager, webhook), lines):
        assert re.fullmatch(rf"alert ChampionRolledBack not delivered to {kind} \({peer.url}\) after 1 attempt: "
                            rf"DeadlinePassed: no whole answer within {DEADLINE} s", line), line
        assert_in_time(peer, ended, rest=2 * (DEADLINE + 1.0) + EXIT)
    assert_lock_free(mlflow_uri)


def test_a_trickling_reload_url_makes_a_rollback_with_deploys_one_line(mlflow_uri, tmp_path):
    assert [register_tiny_draft(tmp_path, seed=seed) for seed in (1, 2)] == ["1", "2"]
    registry.promote(NAME, "2")
    peer = Trickler()
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump({"device": "cpu", "tracking": {"uri": mlflow_uri, "system_metrics": False},
                                      "monitor": {"state_dir": str(tmp_path / "state"), "deploy": {
                                          "enabled": True, "dir": str(tmp_path / "deploy"), "format": "hf",
                                          "reload": "url", "reload_url": f"{peer.url}/reload",
                                          "reload_timeout": DEADLINE}}}))
    try:
        code, out, err, ended = draftops(["monitor", "rollback", "--config", str(config)], tmp_path, mlflow_uri)
    finally:
        peer.close()
    (line,) = said_lines(err)
    assert code == 2 and out.startswith(f"{NAME}@champion -> version 1"), out + err
    assert line.startswith("draftops: error: deploy step reload: reload request: no whole answer from"), line
    assert_in_time(peer, ended)
    assert_lock_free(mlflow_uri)

"""The canary as a team runs it, on loopback: three llama-server replicas of the real SmolLM2 target (a is the canary),
a real Prometheus scraping them every second, a real Alertmanager and tracking server, and the monitor's service
checks reading the windows from Prometheus. Marked `integration` and `llamacpp`; skipped with the reason where
llama-server, Prometheus or Alertmanager is absent.

- A challenger that serves worse (a copy of the updated target: a draft of another target) is deployed to the canary
  alone, caught and rolled back: the fleet's folder only ever held version 1, replicas b and c were never reloaded
  after the first deploy, the champion alias is back, and the alert Alertmanager lists names replica a.
- A good challenger (another copy of the original target) reaches all three replicas.
- `draftops monitor check` killed with SIGKILL in the middle of a canary, then checks again: the canary ends passed
  or failed, and every folder (the fleet's, the canary's) is on a whole deployment.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from decode.serving.export import draft_source, export_format, target_gguf
from monitor.rehearsal.demo_engine import ServedEngine
from monitor.rehearsal.serve_demo import replayed_prompts
from monitor.rehearsal.target_update import run_finetune
from monitor.release import canary as steps
from monitor.release.canary import Canary
from monitor.release.layout import CURRENT, DeployFolder, read_manifest
from pipeline import registry
from pipeline.config import load_config
from pipeline.traffic import DEFAULT_TRAFFIC
from tests.integration.test_fleet_prometheus import (  # noqa: F401 - fixtures
    REPO,
    ServiceCheck,
    Traffic,
    binaries,
    eventually,
    tracking_and_alerts,
    until_boundary,
)
from tests.loopback_servers import Prometheus
from tests.monitor.rehearsal.test_serve_demo import register_copy

pytestmark = [pytest.mark.integration, pytest.mark.llamacpp]
WINDOW, WINDOWS = 15, 3
RELOAD_FLEET = """import json, sys, urllib.request
for url in sys.argv[1:-1]:
    body = json.dumps({"file": sys.argv[-1]}).encode()
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=600).read()
"""


def served_draft(folder: Path, cfg) -> Path:
    return next(export_format(draft_source(str(folder)), "gguf", folder.with_name(folder.name + "-gguf"),
                              vocabulary=target_gguf(cfg.target)).glob("*.gguf"))


def checked(overrides: list[str]):
    service = ServiceCheck(overrides)
    try:
        report = service.report()
    finally:
        service.stop()
    print(report.summary())
    return report


def until_judged(overrides: list[str], checks: int = 4):
    """Service checks a window apart until one judges the canary."""
    for _ in range(checks):
        until_boundary(WINDOWS + 1)
        report = checked(overrides)
        if report.canary is not None and report.canary.verdict != "collecting":
            return report
    raise AssertionError("the canary was never judged")


def test_a_canary_on_three_llama_servers(tmp_path, binaries, tracking_and_alerts, monkeypatch):  # noqa: F811
    prometheus_binary, _, llama_binaries, home = binaries
    tracking, alertmanager = tracking_and_alerts
    monkeypatch.setenv("DRAFTOPS_LLAMA_CPP", str(llama_binaries))
    if home:
        monkeypatch.setenv("DRAFTOPS_HOME", home)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking.url)
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    prompts_file = tmp_path / "update_prompts.jsonl"
    with open(DEFAULT_TRAFFIC) as f:
        prompts_file.write_text("".join(line for line, _ in zip(f, range(16))))
    common = [f"tracking.uri={tracking.url}", "monitor.heldout_requests=16", "monitor.n_bootstrap=300",
              "decode.max_new_tokens=32", f"target_update.prompts={prompts_file}", "target_update.max_prompts=16",
              "target_update.steps=15", f"target_update.output_dir={tmp_path / 'target-updated'}",
              f"monitor.state_dir={tmp_path / 'state'}"]
    cfg = load_config(REPO / "configs" / "serve_demo.yaml", common)
    name = cfg.tracking.registered_model
    assert register_copy(cfg, tmp_path / "v1") == "1"
    updated = run_finetune(cfg).path
    bad_cfg = load_config(REPO / "configs" / "serve_demo.yaml", [*common, f"target={updated}"])
    served = target_gguf(cfg.target)
    draft = served_draft(tmp_path / "v1", cfg)
    engines = {n: ServedEngine(served, draft=draft, draft_max=cfg.decode.gamma, threads=1,
                               log_dir=tmp_path / f"engine-{n}") for n in "abc"}
    script = tmp_path / "reload_fleet.py"
    script.write_text(RELOAD_FLEET)
    started, traffic, prometheus = [], [], None
    try:
        for engine in engines.values():
            started.append(engine.__enter__())
        prometheus = Prometheus(prometheus_binary, {n: f"127.0.0.1:{e.port}" for n, e in engines.items()},
                                tmp_path / "prometheus")
        overrides = [
            *common, f"monitor.prometheus_url={prometheus.url}", f"monitor.prometheus_window={WINDOW}s",
            "monitor.prometheus_replica_label=replica", 'monitor.prometheus_selector=job="llama"',
            f"monitor.engines={json.dumps([{'replica': n, 'url': e.metrics_url} for n, e in engines.items()])}",
            "monitor.server_baseline_windows=8", "monitor.server_recent_windows=3", "monitor.metrics_port=0",
            "monitor.schedule=0 3 * * *", "monitor.deploy.enabled=true", "monitor.deploy.format=gguf",
            f"monitor.deploy.dir={tmp_path / 'deploy'}", "monitor.deploy.engine_check=off",
            f"monitor.deploy.reload_command={json.dumps([sys.executable, str(script), engines['b'].reload_url, engines['c'].reload_url, '{file}'])}",  # noqa: E501
            f"monitor.deploy.canary={json.dumps({'replicas': ['a'], 'windows': WINDOWS, 'reload': 'url', 'reload_url': engines['a'].reload_url})}",  # noqa: E501
            f"monitor.alerts.targets={json.dumps([{'kind': 'alertmanager', 'url': alertmanager.url}])}"]
        traffic = [Traffic(engine, replayed_prompts(cfg), cfg.decode.max_new_tokens) for engine in engines.values()]
        fleet_root, canary_root = tmp_path / "deploy", tmp_path / "deploy" / "canary"
        fleet_folder, canary_folder = DeployFolder(fleet_root), DeployFolder(canary_root)
        first = checked(overrides)  # version 1 to the fleet's folder and the canary's
        assert fleet_folder.linked(CURRENT).version == canary_folder.linked(CURRENT).version == "1", first.summary()
        fleet_reloads = {n: len(engines[n].reloads) for n in "bc"}

        # a challenger that serves worse: a copy of the updated target, a draft of another target
        assert register_copy(bad_cfg, tmp_path / "v2") == "2"
        registry.promote(name, "2")
        begun = checked(overrides)
        assert canary_folder.linked(CURRENT).version == "2" and fleet_folder.linked(CURRENT).version == "1"
        assert [r.action for r in begun.deploys] == ["canary"], begun.summary()
        failed = until_judged(overrides)
        assert failed.canary.verdict == "fail" and failed.canary.canary == ["a"], failed.summary()
        assert registry.champion(name).version == "1" and canary_folder.linked(CURRENT).version == "1"
        assert sorted(os.listdir(fleet_root / "versions")) == ["v1"]
        assert {n: len(engines[n].reloads) for n in "bc"} == fleet_reloads  # b and c never touched
        alerts = eventually(lambda: [a["labels"] for a in alertmanager.alerts()
                                     if a["labels"].get("alertname") == "CanaryFailed"])
        assert [a.get("replica") for a in alerts] == ["a"], alerts

        # a good challenger: another copy of the original target
        assert register_copy(cfg, tmp_path / "v3") == "3"
        registry.promote(name, "3")
        checked(overrides)
        passed = until_judged(overrides)
        assert passed.canary.verdict == "pass", passed.summary()
        assert fleet_folder.linked(CURRENT).version == "3" and canary_folder.linked(CURRENT).version == "3"
        assert all(Path(engines[n].draft).parent.name.startswith("v3") for n in "abc")

        # killed in the middle of a canary, then checked again: it ends, every folder whole
        assert register_copy(cfg, tmp_path / "v4") == "4"
        registry.promote(name, "4")
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        check = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "monitor", "check", "--config",
                                  str(REPO / "configs" / "serve_demo.yaml"), *overrides], env=env)
        run_cfg = load_config(REPO / "configs" / "serve_demo.yaml", overrides)
        eventually(lambda: Canary(run_cfg).read().get("version") == "4" or check.poll() is not None, timeout=900)
        check.send_signal(signal.SIGKILL)
        check.wait()
        ended = None
        for _ in range(5):
            until_boundary(WINDOWS + 1)
            checked(overrides)
            ended = Canary(run_cfg).read().get("phase")
            if ended in (steps.PASSED, steps.FAILED):
                break
        assert ended in (steps.PASSED, steps.FAILED), ended
        for root in (fleet_root, canary_root):
            current = DeployFolder(root).linked(CURRENT)
            assert current is not None and read_manifest(current.folder) == current
    finally:
        for flow in traffic:
            flow.close()
        if prometheus is not None:
            prometheus.close()
        for engine in started:
            engine.__exit__(None, None, None)

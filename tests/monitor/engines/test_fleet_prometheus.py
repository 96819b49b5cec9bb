"""A fleet of two llama-server replicas scraped by a real Prometheus, on loopback (marked `integration` and `llamacpp`;
skipped with the reason where Prometheus' or llama.cpp's binary is absent: `apt-get install prometheus`, `draftops
llama-cpp build`).

Both replicas serve the real SmolLM2 target with the champion draft (a copy of the target, exported as GGUF, so that
the acceptance is high and falls unmistakably with the target), traffic replayed to both without a pause; Prometheus
scrapes both every second under `replica="a"` and `replica="b"`. The checks read the replicas' windows (15 s) from
Prometheus' API: the first, after 8 windows, records the champion's offline baseline and finds each replica's baseline
windows; then replica b alone is restarted on an updated target (LoRA, merged, written as GGUF as the serve demo does),
and the check 3 windows later finds b, and not a, DRIFT, with its name in the report and as the replica parting from
the other."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from decode.serving.export import draft_source, export_format, target_gguf
from decode.serving.llamacpp import find_server, free_port
from monitor.check.decision import Cause, Status
from monitor.check.run import run_check
from monitor.engines.fleet import fleet_verdict
from monitor.rehearsal.demo_engine import ServedEngine, write_target_gguf
from monitor.rehearsal.serve_demo import replayed_prompts
from monitor.rehearsal.target_update import run_finetune
from pipeline.config import load_config
from pipeline.traffic import DEFAULT_TRAFFIC
from tests.monitor.rehearsal.test_serve_demo import register_copy

pytestmark = [pytest.mark.integration, pytest.mark.llamacpp]
REPO = Path(__file__).resolve().parents[3]
WINDOW = 15  # seconds: Prometheus scrapes every second, so a window holds 15 samples
BASELINE, RECENT = 8, 3  # 1 / C(11, 3) < 0.05 / 3: each replica's test can alarm beside the fleet's


@pytest.fixture(scope="module")
def binaries():
    prometheus, server = shutil.which("prometheus"), find_server()
    if prometheus is None:
        pytest.skip("no prometheus binary (Debian: apt-get install prometheus)")
    if server is None:
        pytest.skip("no llama-server (draftops llama-cpp build, or make test-llamacpp)")
    return Path(prometheus), server.parent, os.environ.get("DRAFTOPS_HOME")


class Prometheus:
    """A real Prometheus on a loopback port, scraping the given {replica: host:port} every second."""

    def __init__(self, binary: Path, targets: dict[str, str], folder: Path):
        self.port = free_port()
        folder.mkdir(parents=True, exist_ok=True)
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "scrape_configs": [{"job_name": "llama", "static_configs": [
                      {"targets": [target], "labels": {"replica": name}} for name, target in targets.items()]}]}
        (folder / "prometheus.yml").write_text(json.dumps(config))
        self.log = open(folder / "prometheus.log", "w")
        self.process = subprocess.Popen(
            [str(binary), f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if urllib.request.urlopen(f"{self.url}/-/ready", timeout=2).status == 200:
                    return
            except OSError:
                time.sleep(0.5)
        self.close()
        raise RuntimeError(f"Prometheus did not get ready: {(folder / 'prometheus.log').read_text()[-2000:]}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.process.terminate()  # Prometheus shuts down cleanly on SIGTERM
        self.process.wait(timeout=60)
        self.log.close()


class Traffic:
    """The held-out prompts sent to one replica in a loop, greedy, until stopped."""

    def __init__(self, engine: ServedEngine, prompts: list[list[int]], max_new_tokens: int):
        self.engine, self.prompts, self.max_new_tokens = engine, prompts, max_new_tokens
        self.stop, self.sent, self.errors = threading.Event(), 0, []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.engine.complete(self.prompts[self.sent % len(self.prompts)], self.max_new_tokens)
                self.sent += 1
            except Exception as exc:  # a restart in progress: the next request waits for it
                self.errors.append(repr(exc))
                time.sleep(0.2)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=120)


def until_boundary(windows: int = 1) -> None:
    """Sleep past the `windows`-th window boundary from now (and a second more, for Prometheus' last scrape)."""
    time.sleep((time.time() // WINDOW + windows) * WINDOW - time.time() + 1.5)


def test_the_replica_on_an_updated_target_is_drift_by_name_and_the_other_is_not(tmp_path, mlflow_uri, binaries,
                                                                               monkeypatch):
    prometheus_binary, llama_binaries, home = binaries
    monkeypatch.setenv("DRAFTOPS_LLAMA_CPP", str(llama_binaries))
    if home:
        monkeypatch.setenv("DRAFTOPS_HOME", home)
    prompts_file = tmp_path / "update_prompts.jsonl"
    with open(DEFAULT_TRAFFIC) as f:
        prompts_file.write_text("".join(line for line, _ in zip(f, range(16))))
    common = [f"tracking.uri={mlflow_uri}", "monitor.heldout_requests=16", "monitor.n_bootstrap=300",
              "decode.max_new_tokens=32", "distill.max_new_tokens=32", "distill.generation_batch_size=16",
              f"target_update.prompts={prompts_file}", "target_update.max_prompts=16", "target_update.steps=15",
              f"target_update.output_dir={tmp_path / 'target-updated'}", f"monitor.state_dir={tmp_path / 'state'}",
              "monitor.deploy.enabled=false", "monitor.deploy.engine_check=off"]
    cfg = load_config(REPO / "configs" / "serve_demo.yaml", common)
    register_copy(cfg, tmp_path / "v1")  # version 1, the champion
    draft = next(export_format(draft_source(str(tmp_path / "v1")), "gguf", tmp_path / "draft-gguf",
                               vocabulary=target_gguf(cfg.target)).glob("*.gguf"))
    served = target_gguf(cfg.target)
    updated = write_target_gguf(run_finetune(cfg).path, served, tmp_path / "target-updated.gguf")
    prompts = replayed_prompts(cfg)
    engines = {name: ServedEngine(served, draft=draft, draft_max=cfg.decode.gamma, threads=1,
                                  log_dir=tmp_path / f"engine-{name}") for name in ("a", "b")}
    started, traffic, prometheus = [], [], None
    try:
        for engine in engines.values():
            started.append(engine.__enter__())
        prometheus = Prometheus(prometheus_binary, {n: f"127.0.0.1:{e.port}" for n, e in engines.items()},
                                tmp_path / "prometheus")
        fleet = load_config(REPO / "configs" / "serve_demo.yaml", [
            *common, f"monitor.prometheus_url={prometheus.url}", f"monitor.prometheus_window={WINDOW}s",
            "monitor.prometheus_replica_label=replica", 'monitor.prometheus_selector=job="llama"',
            f"monitor.engines={json.dumps([{'replica': n, 'url': e.metrics_url} for n, e in engines.items()])}",
            f"monitor.server_baseline_windows={BASELINE}", f"monitor.server_recent_windows={RECENT}"])
        until_boundary()
        traffic = [Traffic(engine, prompts, cfg.decode.max_new_tokens) for engine in engines.values()]
        until_boundary(BASELINE)
        first = run_check(fleet)  # the offline baseline; each replica's baseline windows from Prometheus
        print(first.summary())
        assert first.baseline_recorded and first.server.source == "prometheus"
        assert all(r.n_baseline_windows == BASELINE for r in first.server.replicas), first.summary()
        engines["b"].restart(target=updated)  # the target update rolled out to replica b alone
        until_boundary(RECENT + 1)
        report = run_check(fleet)
        summary = report.summary()
        print(summary)
        verdict, replicas = fleet_verdict(report.server)
        assert replicas == {"a": "OK", "b": "DRIFT"}, summary
        assert verdict == "DRIFT" and report.decision.status is Status.DRIFT, summary
        assert report.decision.cause is Cause.SERVER_ACCEPTANCE_DROPPED  # the offline check (original target) saw none
        assert "DRIFT on replica b, not on a" in report.decision.reasons, summary
        assert "replica b (llamacpp): DRIFT" in summary and "replica a (llamacpp): OK" in summary
        assert [o.replica for o in report.server.outliers()] == ["b"], summary
    finally:
        for flow in traffic:
            flow.close()
        if prometheus is not None:
            prometheus.close()
        for engine in started:
            engine.__exit__(None, None, None)

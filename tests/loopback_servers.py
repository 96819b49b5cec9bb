"""Real servers on loopback for integration tests: MLflow's tracking server, Prometheus and Alertmanager.

Each starts its own process on a free port, waits until it answers its readiness endpoint (bounded), and stops it on
`close()`; the test skips with the reason where a binary is absent (Debian: `apt-get install prometheus
prometheus-alertmanager`). Their logs stay in the given folder for the failure message.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from decode.serving.llamacpp import free_port

READY_TIMEOUT_S = 90


def binary(*names: str) -> Path | None:
    """The first of `names` on PATH (Debian names Alertmanager's binary prometheus-alertmanager)."""
    for name in names:
        found = shutil.which(name)
        if found:
            return Path(found)
    return None


class LoopbackServer:
    """A server process on 127.0.0.1:`port`, in its own process group, ready once `ready_path` answers 200."""

    ready_path = "/-/ready"

    def __init__(self, command: list[str], folder: Path, port: int, name: str):
        self.port, self.name, self.folder = port, name, folder
        folder.mkdir(parents=True, exist_ok=True)
        self.log_path = folder / f"{name}.log"
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, cwd=folder,
                                        start_new_session=True)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(self.url + self.ready_path, timeout=5) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"{name} did not get ready at {self.url}: {self.log_path.read_text()[-2000:]}")
            time.sleep(0.5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get_json(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=10) as answer:
            return json.loads(answer.read())

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)  # each shuts down cleanly on SIGTERM
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        self.log.close()


class TrackingServer(LoopbackServer):
    """`mlflow server` as a team runs it: a sqlite backend (`folder`/mlflow.db, or an existing store's URI) and a local
    artifact folder it serves (mlflow-artifacts:)."""

    ready_path = "/health"

    def __init__(self, folder: Path, backend_uri: str | None = None):
        port = free_port()
        folder.mkdir(parents=True, exist_ok=True)
        super().__init__([sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                          backend_uri or f"sqlite:///{folder / 'mlflow.db'}",
                          "--artifacts-destination", str(folder / "artifacts"),
                          "--host", "127.0.0.1", "--port", str(port), "--workers", "1"], folder, port, "mlflow")


class Prometheus(LoopbackServer):
    """A real Prometheus scraping every second: {replica: host:port} under job `llama` with a `replica` label, and
    any other {job: host:port}."""

    def __init__(self, executable: Path, replicas: dict[str, str], folder: Path, jobs: dict[str, str] | None = None):
        port = free_port()
        folder.mkdir(parents=True, exist_ok=True)
        scrapes = [{"job_name": "llama", "static_configs": [
            {"targets": [target], "labels": {"replica": name}} for name, target in replicas.items()]}]
        scrapes += [{"job_name": job, "static_configs": [{"targets": [target]}]}
                    for job, target in (jobs or {}).items()]
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "scrape_configs": scrapes}
        (folder / "prometheus.yml").write_text(json.dumps(config))
        super().__init__([str(executable), f"--config.file={folder / 'prometheus.yml'}",
                          f"--storage.tsdb.path={folder / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
                          "--log.level=warn"], folder, port, "prometheus")

    def query(self, expression: str) -> list[dict]:
        """An instant query's result vector."""
        from urllib.parse import quote

        return self.get_json(f"/api/v1/query?query={quote(expression)}")["data"]["result"]


class Alertmanager(LoopbackServer):
    """A real Alertmanager, alone (no cluster), routing every alert to a receiver that sends nowhere: what its API
    lists is what the monitor sent."""

    def __init__(self, executable: Path, folder: Path):
        port = free_port()
        folder.mkdir(parents=True, exist_ok=True)
        config = {"route": {"receiver": "nowhere", "group_wait": "1s"}, "receivers": [{"name": "nowhere"}]}
        (folder / "alertmanager.yml").write_text(json.dumps(config))
        super().__init__([str(executable), f"--config.file={folder / 'alertmanager.yml'}",
                          f"--storage.path={folder / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                          "--cluster.listen-address=", "--log.level=warn"], folder, port, "alertmanager")

    def alerts(self) -> list[dict]:
        return self.get_json("/api/v2/alerts")

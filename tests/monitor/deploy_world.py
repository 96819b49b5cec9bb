"""What the deploy tests share: tiny registered drafts, a reload command that records its calls, a fake engine (a
Prometheus endpoint on 127.0.0.1 whose llama-server counters advance at a set acceptance on every scrape), a server
that trickles its headers, and an engine's HTTP endpoints that record the requests they get."""
from __future__ import annotations

import contextlib
import http.server
import json
import socket
import sys
import threading
from pathlib import Path

import mlflow
import yaml

from distill.register import export_draft
from pipeline import metrics as M
from pipeline import registry
from pipeline.config import load_config
from tests.conftest import make_tiny_model, make_tokenizer
from tests.monitor.check.test_run import write_traffic

NAME = "draftops-draft"
RECORDER = """import os, sys
if os.path.exists(sys.argv[1] + ".fail"):
    sys.exit("engine refused the reload")
with open(sys.argv[1], "a") as f:
    f.write(" ".join(sys.argv[2:]) + "\\n")
"""


def register_tiny_draft(root: Path, seed: int, fingerprint: str = "fp-A") -> str:
    """A tiny layer draft exported as distill does and registered; returns its version."""
    tokenizer = make_tokenizer()
    cfg = load_config(None, ["decode.gamma=3", "device=cpu"])
    folder = export_draft(make_tiny_model(len(tokenizer), seed=seed), tokenizer, root / f"draft-{seed}",
                          token_ids=None, cfg=cfg)
    mlflow.set_experiment("draftops-distill")
    with mlflow.start_run():
        version, _ = registry.register(folder, NAME, tags={M.TARGET_FINGERPRINT_TAG: fingerprint},
                                       description="tiny test draft")
    return str(version.version)


def recorder(root: Path) -> tuple[list[str], Path]:
    """(a reload command, the file it appends its arguments to)."""
    script, calls = root / "reload.py", root / "reloads.txt"
    script.write_text(RECORDER)
    return [sys.executable, str(script), str(calls), "{version}", "{path}", "{file}", "{current}"], calls


def calls_of(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def write_config(root: Path, mlflow_uri: str, traffic: Path, **deploy) -> Path:
    command, _ = recorder(root)
    path = root / "cfg.yaml"
    path.write_text(yaml.safe_dump({
        "device": "cpu", "traffic": {"path": str(traffic), "heldout_fraction": 0.5},
        "tracking": {"uri": mlflow_uri, "system_metrics": False},
        "monitor": {"heldout_requests": 30, "state_dir": str(root / "state"), "n_bootstrap": 300,
                    "scrape_interval_minutes": 0,  # every check reads the engine (no service scrapes between)
                    "deploy": {"enabled": True, "dir": str(root / "deploy"), "format": "hf",
                               "reload_command": command, **deploy}}}))
    return path


def two_drafts_world(root: Path, mlflow_uri: str):
    """Versions 1 (champion) and 2 of tiny drafts, and a config deploying them as hf with the recording reload: the
    deploy tests' `world` fixture (tests/monitor/release/conftest.py, tests/hostile_inputs/test_deploy_failures.py)."""
    traffic = root / "traffic.jsonl"
    write_traffic(traffic, 0, 40)
    assert register_tiny_draft(root, seed=1) == "1"
    assert register_tiny_draft(root, seed=2) == "2"
    return load_config(write_config(root, mlflow_uri, traffic)), root


def llamacpp_text(drafts: float, draft_tokens: float, accepted: float) -> str:
    return "".join(f"# TYPE llamacpp:{name} counter\nllamacpp:{name} {value:g}\n" for name, value in (
        ("spec_decode_num_drafts_total", drafts), ("spec_decode_num_draft_tokens_total", draft_tokens),
        ("spec_decode_num_accepted_tokens_total", accepted), ("tokens_predicted_total", accepted + drafts)))


class FakeEngine(http.server.BaseHTTPRequestHandler):
    """GET /metrics: llama-server's counters, `window` more draft tokens at `acceptance` each time (a few points of
    seeded noise per window; an acceptance above 1 as it is, an engine whose counters cannot be true); POST /reload:
    recorded."""

    def do_GET(self):
        engine = self.server
        if self.path != "/metrics":
            self.send_error(404)
            return
        jitter = ((engine.scrapes * 7919) % 11 - 5) / 250  # -0.02 .. +0.02, deterministic
        engine.scrapes += 1
        engine.draft_tokens += engine.window
        share = engine.acceptance if engine.acceptance > 1 else min(max(engine.acceptance + jitter, 0.0), 1.0)
        engine.accepted += round(engine.window * share)  # above 1: counters that cannot be true
        engine.drafts += engine.window / 3
        self._answer(llamacpp_text(engine.drafts, engine.draft_tokens, engine.accepted).encode())

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.reloads.append(body.decode())
        self._answer(b"{}")

    def _answer(self, body: bytes, status: int = 200, content_type: str = "text/plain; version=0.0.4"):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def start_engine(acceptance: float, window: int = 600) -> http.server.ThreadingHTTPServer:
    engine = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeEngine)
    engine.acceptance, engine.window, engine.scrapes = acceptance, window, 0
    engine.drafts = engine.draft_tokens = engine.accepted = 0.0
    engine.reloads = []
    engine.thread = threading.Thread(target=engine.serve_forever, daemon=True)
    engine.thread.start()
    return engine


def stop_engine(engine) -> None:
    engine.shutdown()
    engine.server_close()
    engine.thread.join()


@contextlib.contextmanager
def trickling_server(interval: float = 1.0):
    """A socket server on 127.0.0.1 that answers each connection with a status line and then one header line every
    `interval` seconds, never ending its headers; yields its /reload URL."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    stop = threading.Event()

    def trickle(connection: socket.socket) -> None:
        with connection, contextlib.suppress(OSError):
            connection.sendall(b"HTTP/1.1 200 OK\r\n")
            line = 0
            while not stop.wait(interval):
                connection.sendall(f"X-Slow-{line}: {line}\r\n".encode())
                line += 1

    def serve() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                connection, _ = listener.accept()
                threading.Thread(target=trickle, args=(connection,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/reload"
    finally:
        stop.set()
        thread.join()
        listener.close()


class RecordingEngine(FakeEngine):
    """An engine's HTTP endpoints as a fake: every POST recorded as (path with query, JSON body); answers
    `server.answers[path]` as (status, JSON body), else 200 {"success": true}."""

    def do_POST(self):
        length = int(self.headers.get("Content-Length", 0))
        body = json.loads(self.rfile.read(length)) if length else None
        self.server.requests.append((self.path, body))
        status, answer = self.server.answers.get(self.path.split("?")[0], (200, {"success": True, "message": "ok"}))
        self._answer(json.dumps(answer).encode(), status, "application/json")


@contextlib.contextmanager
def recording_engine(answers: dict | None = None):
    """A RecordingEngine on 127.0.0.1; yields the server (its `requests`, its base URL as `url`)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), RecordingEngine)
    server.requests, server.answers = [], answers or {}
    server.url = f"http://127.0.0.1:{server.server_port}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()

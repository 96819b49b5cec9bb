"""A tracking server that answers /health but hangs its API: every command that talks to it ends with one line on
stderr (no traceback, no library warnings) and exit 2, within BOUND_S of the first request the server holds: one
request may take HTTP_TIMEOUT_S × (HTTP_RETRIES + 1) seconds, and the command gives up after it. A server whose API
hangs altogether is caught by the check before any work; one that answers that check and then hangs (it went down
mid-command) fails the command's first registry call, never as a version "not in the registry"."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pipeline.tracking import API_PROBE

REPO = Path(__file__).resolve().parents[2]
HTTP_TIMEOUT_S, HTTP_RETRIES = 1, 1
BOUND_S = HTTP_TIMEOUT_S * (HTTP_RETRIES + 1) + 10.0  # + the interpreter's exit on a loaded 2-core machine


class HangingTracking:
    """/health answers OK; every other path hangs (`answers_probe`: except the API path `check_tracking` asks)."""

    def __init__(self, answers_probe: bool):
        released = self.released = threading.Event()
        self.held_at: list[float] = []
        held_at = self.held_at

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path == "/health" or (answers_probe and self.path == API_PROBE):
                    body = b"OK" if self.path == "/health" else b'{"experiments": []}'
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                held_at.append(time.monotonic())
                released.wait(120)

            do_POST = do_PATCH = do_DELETE = do_GET

        class Quiet(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):
                pass

        self.server = Quiet(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.uri = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


COMMANDS = {
    "monitor check": ["monitor", "check"],
    "rollback": ["monitor", "rollback"],
    "rollback --to-version": ["monitor", "rollback", "--to-version", "3"],
    "report": ["report"],
    "models info": ["models", "info", "models:/draftops-draft@champion"],
    "eval": ["eval", "--draft", "models:/draftops-draft@champion", "--target", "TINY", "cpu_linear=torch"],
    "distill": ["distill"],
}


def run(argv: list[str], server: HangingTracking, home: Path) -> tuple[int, str, float]:
    """`draftops ARGV` in a fresh interpreter against `server`: its exit code, its stderr and the seconds from the
    first request the server held to its end. "TINY" in ARGV is a tiny target's folder."""
    if "TINY" in argv:
        from tests.distill.tiny_job import write_target

        argv = [str(write_target(home / "target")) if word == "TINY" else word for word in argv]
    # the registry too: an MLFLOW_REGISTRY_URI an earlier test of this process left in os.environ would win
    env = {**os.environ, "MLFLOW_TRACKING_URI": server.uri, "MLFLOW_REGISTRY_URI": server.uri,
           "PYTHONPATH": str(REPO), "DRAFTOPS_HOME": str(home),
           "MLFLOW_HTTP_REQUEST_TIMEOUT": str(HTTP_TIMEOUT_S), "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(HTTP_RETRIES)}
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", *argv], cwd=home, env=env, capture_output=True,
                         text=True, timeout=120)
    assert server.held_at, out.stderr[-3000:]
    return out.returncode, out.stderr, time.monotonic() - server.held_at[0]


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and re.match(r"draftops( distill)?: error: ", lines[0]), err[-3000:]
    assert "Traceback" not in err and "WARNING" not in err and "Warning" not in err
    return lines[0]


@pytest.fixture
def hanging(request):
    server = HangingTracking(answers_probe=request.param)
    yield server
    server.close()


@pytest.mark.parametrize("hanging", [False], indirect=True)
@pytest.mark.parametrize("command", [c for c in COMMANDS if c != "rollback --to-version"])
def test_a_tracking_server_whose_api_hangs_is_one_line_before_any_work(hanging, command, tmp_path):
    code, err, seconds = run(COMMANDS[command], hanging, tmp_path)
    line = one_line(err)
    assert code == 2 and seconds < BOUND_S, (seconds, err[-2000:])
    assert f"the MLflow tracking server {hanging.uri} answers /health but not its API" in line


@pytest.mark.parametrize("hanging", [True], indirect=True)
@pytest.mark.parametrize("command", ["monitor check", "rollback --to-version", "report", "models info", "eval"])
def test_a_tracking_server_that_hangs_after_the_check_is_one_line_never_a_missing_version(hanging, command, tmp_path):
    code, err, seconds = run(COMMANDS[command], hanging, tmp_path)
    line = one_line(err)
    assert code == 2 and seconds < BOUND_S, (seconds, err[-2000:])
    assert f"the MLflow store {hanging.uri} failed" in line and "Read timed out" in line
    assert "not in the MLflow registry" not in line

"""What an incident throws at the monitor: a metrics endpoint that answers slowly, a registration waiting for a busy
model, an operator's rollback to an odd version, a bad pairs file, a check that crashes. Each ends within its
deadline with one line and a documented exit code."""
import json
import os
import socketserver
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlflow
import pytest
import yaml
from mlflow import MlflowClient

from monitor.fleet.counters import ServerMetricsError, scrape
from monitor.fleet.verdicts import read_fleet
from pipeline import metrics as M
from pipeline import registry
from pipeline.cli import main
from pipeline.config import load_config
from pipeline.locks import ModelBusy, model_lock

REPO = Path(__file__).resolve().parents[2]
NAME = "draftops-draft"


class _Trickle(socketserver.BaseRequestHandler):
    """Answers one byte-sized piece every `server.pause` seconds: the headers slowly (`server.slow_headers`) or a
    metrics body of 40 lines, one line at a time."""

    def handle(self):
        self.request.recv(65536)
        pause = self.server.pause
        try:
            if self.server.slow_headers:
                self.request.sendall(b"HTTP/1.0 200 OK\r\n")
                for i in range(40):
                    time.sleep(pause)
                    self.request.sendall(f"X-Slow-{i}: yes\r\n".encode())
                return
            self.request.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n")
            for i in range(40):
                time.sleep(pause)
                self.request.sendall(f"# line {i}\n".encode())
        except OSError:  # the client gave up: what the deadline is for
            pass


@pytest.fixture
def trickling():
    servers = []

    def start(slow_headers: bool = False, pause: float = 0.5) -> str:
        server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Trickle)
        server.daemon_threads, server.slow_headers, server.pause = True, slow_headers, pause
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/metrics"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("slow_headers", [False, True])
def test_a_trickling_metrics_endpoint_is_cut_off_at_the_deadline(trickling, slow_headers):
    """One line every 0.5 s for 20 s: each read is quick, so a per-read timeout never fires; the deadline does."""
    url = trickling(slow_headers=slow_headers)
    start = time.monotonic()
    with pytest.raises(ServerMetricsError, match=r"no complete answer within 2 s \(monitor.server_timeout\)"):
        scrape(url, timeout=2)
    assert time.monotonic() - start < 3.5


def test_the_check_reads_a_slow_endpoint_within_its_deadline_and_goes_on(trickling, tmp_path):
    cfg = load_config(None, [f"monitor.server_metrics_url={trickling()}", "monitor.server_timeout=2",
                             f"monitor.state_dir={tmp_path}"])
    start = time.monotonic()
    reading = read_fleet(cfg, "1")
    assert time.monotonic() - start < 3.5 and "no complete answer within 2 s" in reading.replicas[0].error


def test_a_registration_waiting_for_a_busy_model_gives_up_with_one_line(mlflow_uri, tiny_checkpoint):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pipeline.locks import model_lock\n"
         "with model_lock(sys.argv[1], sys.argv[2]):\n    print('held', flush=True); time.sleep(60)",
         NAME, mlflow_uri], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        mlflow.set_experiment("registration")
        start = time.monotonic()
        with mlflow.start_run(), pytest.raises(ModelBusy) as err:
            registry.register(tiny_checkpoint, NAME, tags={}, description="d", job="job-a", lock_timeout=1)
        assert 0.9 < time.monotonic() - start < 10
        message = str(err.value)
        assert message.startswith(f"registered model '{NAME}' stayed busy for 1 s: another process holds ")
        assert "draftops distill --register-only" in message and "\n" not in message
    finally:
        holder.kill()
        holder.wait()
    with pytest.raises(ValueError, match="finite timeout"):
        with model_lock(NAME, mlflow_uri, timeout=None):
            pass


@pytest.fixture
def three_versions(tmp_path, mlflow_uri):
    """Versions 1 (previous-champion), 2 (challenger) and 3 (champion), and a config for the CLI."""
    client = MlflowClient()
    client.create_registered_model(NAME)
    for _ in range(3):
        client.create_model_version(NAME, source="file:///nonexistent")
    for alias, version in ((M.PREVIOUS_CHAMPION, "1"), (M.CHALLENGER, "2"), (M.CHAMPION, "3")):
        client.set_registered_model_alias(NAME, alias, version)
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump({"tracking": {"uri": mlflow_uri, "system_metrics": False},
                                      "monitor": {"state_dir": str(tmp_path / "state")}}))
    return config


def aliases() -> dict[str, str]:
    return {alias: str(v) for alias, v in MlflowClient().get_registered_model(NAME).aliases.items()}


@pytest.mark.parametrize("version, reason", [
    ("abc", "--to-version 'abc': a version is a number (see `draftops report`)"),
    ("99", f"registered model '{NAME}' has no version 99 (versions: 1, 2, 3)"),
])
def test_a_rollback_to_a_version_that_is_not_there_is_one_line(three_versions, capsys, version, reason):
    assert main(["monitor", "rollback", "--config", str(three_versions), "--to-version", version]) == 2
    err = capsys.readouterr().err
    assert err == f"draftops: error: {reason}\n"
    assert aliases() == {M.PREVIOUS_CHAMPION: "1", M.CHALLENGER: "2", M.CHAMPION: "3"}


def test_a_rollback_to_the_challenger_makes_it_champion_and_drops_the_challenger_alias(three_versions, capsys):
    assert main(["monitor", "rollback", "--config", str(three_versions), "--to-version", "2"]) == 0
    assert aliases() == {M.CHAMPION: "2", M.PREVIOUS_CHAMPION: "3"}  # never champion and challenger on one version
    assert main(["monitor", "rollback", "--config", str(three_versions)]) == 0
    assert aliases() == {M.CHAMPION: "3", M.PREVIOUS_CHAMPION: "2"}


@pytest.mark.parametrize("content, reason", [
    (None, "cannot be read: No such file or directory"),
    ("not json", "not a JSON file"),
    (json.dumps({"accepted": [1, 2]}), "needs 'accepted' and 'drafted' lists"),
    (json.dumps([[1, 2]]), "at least two"),
    (json.dumps([[1, 2], [3, "x"]]), "pair 1 is [3, 'x']"),
    (json.dumps([[1, 2], [5, 4]]), "0 <= accepted <= drafted"),
    (json.dumps({"accepted": [1, 2], "drafted": [3]}), "differ in length"),
])
def test_a_missing_or_bad_pairs_file_is_one_line(tmp_path, capsys, content, reason):
    pairs = tmp_path / "pairs.json"
    if content is not None:
        pairs.write_text(content)
    code = main(["monitor", "simulate", "--pairs", str(pairs), "--checks", "5", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"draftops: error: --pairs {pairs}: ") and reason in err
    assert err.count("\n") == 1


CRASHING_CHECK = """
import sys
import monitor.check.run

def crash(cfg):
    raise RuntimeError("boom: a bug the check did not expect")

monitor.check.run.run_check = crash
from pipeline.cli import main
sys.exit(main(["monitor", "check", "--config", sys.argv[1]]))
"""


def test_a_crashing_check_prints_one_line_and_keeps_its_traceback(three_versions, tmp_path):
    out = subprocess.run([sys.executable, "-c", CRASHING_CHECK, str(three_versions)], cwd=tmp_path, timeout=180,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
    assert out.returncode == 2, out.stderr[-2000:]
    traceback_file = tmp_path / "state" / "check-error.txt"
    assert out.stderr.strip().splitlines()[-1] == (
        "draftops: error: monitor check failed: RuntimeError: boom: a bug the check did not expect (traceback: "
        f"{traceback_file})")
    assert "Traceback" not in out.stderr and "Traceback" in traceback_file.read_text()


def test_a_long_prompt_is_measured_in_a_batch_of_its_own():
    """The analytic measurement holds logits for every padded position of a batch: one prompt cut to 512 tokens
    among short ones would multiply the batch's memory by its length."""
    from monitor.check.prompt_acceptance import length_batches

    assert length_batches([20, 30, 520, 25], budget=1024) == [[0, 3, 1], [2]]
    assert length_batches([2000, 10], budget=1024) == [[1], [0]]  # longer than the budget: alone
    assert length_batches([10] * 20, budget=1024) == [list(range(8)), list(range(8, 16)), list(range(16, 20))]

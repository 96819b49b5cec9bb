"""`draftops engine serve`: llama-server replicas started as the config (or --replicas) says, a command run while they
are up, and stopped after it; a stand-in llama-server records how it was started."""
from __future__ import annotations

import json
import socket
import sys

import pytest

from decode.serving.llamacpp import LLAMA_CPP_ENV
from pipeline.cli import main

FAKE_SERVER = '''#!{python}
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
with open({record!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
class Health(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{{}}")
HTTPServer(("127.0.0.1", port), Health).serve_forever()
'''


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.fixture
def fake_llama_server(tmp_path, monkeypatch):
    folder = tmp_path / "bin"
    folder.mkdir()
    record = tmp_path / "started.jsonl"
    binary = folder / "llama-server"
    binary.write_text(FAKE_SERVER.format(python=sys.executable, record=str(record)))
    binary.chmod(0o755)
    monkeypatch.setenv(LLAMA_CPP_ENV, str(folder))
    return record


def started(record) -> list[list[str]]:
    return [json.loads(line) for line in record.read_text().splitlines()]


def test_replicas_on_consecutive_ports_run_a_command_and_stop(fake_llama_server, tmp_path, capsys):
    model = tmp_path / "target.gguf"
    model.write_bytes(b"GGUF")
    port = free_ports(1)[0]
    check = f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port + 1}/health'); raise SystemExit(3)"
    code = main(["engine", "serve", "--replicas", "2", "--port", str(port), "--slots", "3", "--threads", "1",
                 "--model", str(model), "--log-dir", str(tmp_path / "logs"), "--", sys.executable, "-c", check])
    assert code == 3  # the command ran while both servers were up; its exit status is the command's
    runs = started(fake_llama_server)
    assert [r[r.index("--port") + 1] for r in runs] == [str(port), str(port + 1)]
    for r in runs:
        assert r[r.index("-np") + 1] == "3" and r[r.index("-c") + 1] == str(3 * 1024) and r[r.index("-t") + 1] == "1"
        assert r[r.index("-m") + 1] == str(model) and r[r.index("--host") + 1] == "127.0.0.1"
    out = capsys.readouterr().out
    assert f"distill.responses.servers=[http://127.0.0.1:{port},http://127.0.0.1:{port + 1}]" in out
    with pytest.raises(OSError):  # stopped after the command
        socket.create_connection(("127.0.0.1", port), timeout=1)


def test_the_configs_loopback_servers_are_started_with_its_concurrency(fake_llama_server, tmp_path):
    model = tmp_path / "target.gguf"
    model.write_bytes(b"GGUF")
    ports = free_ports(2)
    config = tmp_path / "engine.yaml"
    config.write_text(f"distill:\n  responses:\n    engine: openai\n    concurrency: 5\n    servers: "
                      f"[http://127.0.0.1:{ports[0]}, http://localhost:{ports[1]}]\n")
    assert main(["engine", "serve", "--config", str(config), "--model", str(model), "--log-dir", str(tmp_path / "l"),
                 "--", sys.executable, "-c", "pass"]) == 0
    runs = started(fake_llama_server)
    assert sorted(int(r[r.index("--port") + 1]) for r in runs) == sorted(ports)
    assert all(r[r.index("-np") + 1] == "5" for r in runs)


def test_servers_elsewhere_cannot_be_started_here(tmp_path, capsys):
    config = tmp_path / "engine.yaml"
    config.write_text("distill:\n  responses:\n    engine: openai\n    servers: [http://10.0.0.5:8000]\n")
    assert main(["engine", "serve", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("draftops: error: http://10.0.0.5:8000:") and err.count("\n") == 1

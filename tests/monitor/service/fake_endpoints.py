"""Loopback stand-ins for alert receivers: one that records what it gets, one that answers 500, one that is slow, and
a port nobody listens on."""
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from monitor.check.decision import Cause, Decision, Status
from monitor.check.outcome import CheckReport


class Receiver:
    """An HTTP server on 127.0.0.1 that records each POST (path, headers, JSON body) and answers `status` after
    `delay` seconds."""

    def __init__(self, status: int = 200, delay: float = 0.0):
        self.requests: list[dict] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                receiver.requests.append({"path": self.path, "headers": dict(self.headers), "body": json.loads(body)})
                time.sleep(delay)
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                except OSError:  # the client gave up first
                    pass

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def closed_port_url() -> str:
    """The URL of a loopback port that was free a moment ago (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def drift_report(**fields) -> CheckReport:
    report = {"decision": Decision(Status.DRIFT, Cause.TRAFFIC_SHIFTED, reasons=["acceptance dropped 0.10 (p=0.001)"]),
              "registered_model": "draftops-draft", "champion_version": "3", "target_fingerprint": "abc",
              "champion_target_fingerprint": "abc", "current_acceptance": 0.52, "break_even": 0.4}
    return CheckReport(**{**report, **fields})


def drift_check(cfg) -> CheckReport:
    """A stand-in check, referenced by import path, that finds DRIFT."""
    return drift_report()


def ok_check(cfg) -> CheckReport:
    """A stand-in check that finds nothing wrong."""
    return drift_report(decision=Decision(Status.OK, None))


def error_check(cfg) -> CheckReport:
    """A stand-in check that could not reach a verdict (Prometheus unreachable, say)."""
    return drift_report(decision=Decision(Status.ERROR, None, ["Prometheus unreachable at http://127.0.0.1:9"]))

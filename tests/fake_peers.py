"""Hostile peers on loopback for the outbound HTTP client's tests: one that trickles its answer a byte a second (on
every path, or on the paths under one prefix only, answering the others at once), one that redirects to another
origin, and a recorder that keeps every request it gets (the other origin)."""
from __future__ import annotations

import select
import socketserver
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BODY = b'{"status": "success", "data": {}}'.ljust(60)
ANSWER = b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: 60\r\n\r\n" + BODY


class _Trickle(socketserver.BaseRequestHandler):
    def handle(self):
        self.request.settimeout(1.0)
        try:
            request = self.request.recv(65536)
        except OSError:
            request = b""
        path = (request.split(b" ")[1:2] or [b""])[0].decode(errors="replace")
        if not path.startswith(self.server.only):
            self.request.sendall(ANSWER)
            return
        start = 0 if self.server.slow_headers else ANSWER.index(b"\r\n\r\n") + 4
        held = [time.monotonic(), None]
        self.server.held.append(held)
        try:
            self.request.sendall(ANSWER[:start])
            for i in range(start, len(ANSWER)):
                readable, _, _ = select.select([self.request], [], [], self.server.pause)
                if self.server.closing.is_set():
                    return
                if readable and not self.request.recv(65536):  # end of stream: the client hung up
                    break
                self.request.sendall(ANSWER[i:i + 1])
            else:
                return
        except OSError:  # the client gave up: what its deadline is for
            pass
        held[1] = time.monotonic()


class Trickler:
    """Answers every request whose path starts with `only` a byte per `pause` seconds: from the status line on
    (`slow_headers`), or the body; any other request at once. `held`: [when it began trickling, when the client hung
    up (None while it has not)] per trickled request."""

    def __init__(self, slow_headers: bool = True, pause: float = 1.0, only: str = ""):
        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Trickle)
        self.server.daemon_threads = True
        self.server.slow_headers, self.server.pause, self.server.closing = slow_headers, pause, threading.Event()
        self.server.only, self.server.held = only, []
        self.held: list[list[float | None]] = self.server.held
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def cut_within(self) -> float:
        """The longest any trickled request was held before its client hung up (inf while one still holds on)."""
        assert self.held, "no request reached the trickling paths"
        return max(float("inf") if end is None else end - start for start, end in self.held)

    def close(self) -> None:
        self.server.closing.set()
        self.server.shutdown()
        self.server.server_close()


class Recorder:
    """Answers 200 to anything and keeps (method, path, headers) of each request: `location` makes it a redirector
    that answers `status` with that Location instead."""

    def __init__(self, location: str | None = None, status: int = 302):
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                recorder.requests.append((self.command, self.path, dict(self.headers)))
                self.send_response(status if location else 200)
                if location:
                    self.send_header("Location", location + self.path)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            do_GET = do_POST = do_PUT = answer

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def elapsed(call, *args, **kwargs) -> tuple[object, float]:
    """(what `call` returned or raised, seconds it took)."""
    start = time.monotonic()
    try:
        out = call(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        out = exc
    return out, time.monotonic() - start

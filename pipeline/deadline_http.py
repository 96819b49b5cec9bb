"""One HTTP exchange within one deadline: connecting, sending, the status line and headers, and the whole body.

A socket timeout bounds each read, not the exchange: a server that trickles its headers or body a byte at a time keeps
a plain `urllib` request alive indefinitely. Here a timer shuts the connection's socket down when the deadline passes,
which wakes any read blocked on it, and the body is read in pieces with the deadline checked between them.

Every outbound request of draftops goes through `exchange`: the engine source, the engines' metrics, Prometheus'
API, alert delivery, reload requests and the tracking server's checks. Its rules hold for all of them: only http and
https; a redirect is never followed (its 3xx is the answer, and the caller refuses it), so headers such as an alert's
secret never reach another origin; credentials written in the URL (`http://user:password@host`) go in an
Authorization header, never in a message (`pipeline.url_credentials`); the body is bounded.
"""
from __future__ import annotations

import base64
import http.client
import json
import socket
import threading
import urllib.parse
from dataclasses import dataclass

from pipeline.url_credentials import redact

MAX_BODY_BYTES = 256 << 20  # an answer larger than this is refused (no server here sends one)


class DeadlinePassed(TimeoutError):
    """No whole answer within the deadline."""


@dataclass(frozen=True)
class Answer:
    """What came back: the HTTP status, its reason phrase, the whole body, and where a redirect points (not
    followed)."""

    status: int
    reason: str
    body: bytes
    location: str = ""

    def json(self) -> dict:
        """The body as a JSON object; {} when it is not one."""
        try:
            data = json.loads(self.body or b"{}")
        except (ValueError, RecursionError):
            return {}
        return data if isinstance(data, dict) else {}

    def said(self) -> str:
        """The answer in a few words: HTTP status, a redirect's target, or the body's message or error."""
        if 300 <= self.status < 400:
            return f"HTTP {self.status} {self.reason}, a redirect to {redact(self.location)!r} (not followed)"
        data = self.json()
        text = data.get("message") or data.get("error") or data.get("detail") or ""
        return f"HTTP {self.status} {self.reason}" + (f": {str(text).splitlines()[0][:300]}" if text else "")


def origin(url: str) -> str:
    """scheme://host:port of `url`, without credentials, path or query: what a message may name."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")


def _with_credentials(parts: urllib.parse.SplitResult, headers: dict[str, str]) -> dict[str, str]:
    """`headers`, with Basic credentials from the URL's userinfo unless they carry an Authorization already."""
    if parts.username is None or any(key.lower() == "authorization" for key in headers):
        return headers
    user = urllib.parse.unquote(parts.username)
    password = urllib.parse.unquote(parts.password or "")
    token = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
    return {**headers, "Authorization": f"Basic {token}"}


def exchange(url: str, *, data: bytes | None = None, headers: dict[str, str] | None = None, timeout: float,
             max_bytes: int = MAX_BODY_BYTES, method: str | None = None) -> Answer:
    """POST `data` (GET without it; or `method`) to `url` and read the whole answer, all within `timeout` seconds.
    A redirect is returned as it is, never followed.

    Raises DeadlinePassed past the deadline; OSError or `http.client.HTTPException` when the exchange fails otherwise
    (refused, reset, a body cut short); ValueError for a URL that is not http(s) or a body over `max_bytes`."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{redact(url)!r} is not an http(s) URL")
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = kind(parts.hostname, parts.port, timeout=timeout)
    expired = threading.Event()
    opened: list[socket.socket] = []  # the connection lets go of its socket once a response says it closes

    def cut() -> None:
        expired.set()
        for sock in opened:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a read blocked on it
            except OSError:
                pass

    timer = threading.Timer(timeout, cut)
    timer.daemon = True
    timer.start()
    path = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
    try:
        connection.connect()
        opened.append(connection.sock)
        if expired.is_set():
            raise DeadlinePassed
        connection.request(method or ("POST" if data is not None else "GET"), path, body=data,
                           headers=_with_credentials(parts, headers or {}))
        response = connection.getresponse()
        body = bytearray()
        while chunk := response.read(1 << 16):
            body += chunk
            if expired.is_set():
                raise DeadlinePassed
            if len(body) > max_bytes:
                raise ValueError(f"{origin(url)}: an answer over {max_bytes / (1 << 20):g} MiB")
        if expired.is_set():
            raise DeadlinePassed
        if response.length:  # the server closed before the length it announced (http.client does not say)
            raise http.client.IncompleteRead(bytes(body), response.length)
        return Answer(response.status, response.reason, bytes(body), response.getheader("Location") or "")
    except (OSError, http.client.HTTPException) as exc:
        if expired.is_set() or isinstance(exc, TimeoutError):
            raise DeadlinePassed(f"no whole answer within {timeout:.3g} s") from None
        raise
    finally:
        timer.cancel()
        connection.close()

"""One HTTP exchange within one deadline: connecting, sending, the status line and headers, and the whole body.

A socket timeout bounds each read, not the exchange: a server that trickles its headers or body a byte at a time keeps
a plain `urllib` request alive indefinitely. Here a timer shuts the connection's socket down when the deadline passes,
which wakes any read blocked on it, and the body is read in pieces with the deadline checked between them.
"""
from __future__ import annotations

import http.client
import socket
import threading
import urllib.parse
from dataclasses import dataclass

MAX_BODY_BYTES = 256 << 20  # an answer larger than this is refused (no server here sends one)


class DeadlinePassed(TimeoutError):
    """No whole answer within the deadline."""


@dataclass(frozen=True)
class Answer:
    """What came back: the HTTP status, its reason phrase and the whole body."""

    status: int
    reason: str
    body: bytes


def exchange(url: str, *, data: bytes | None = None, headers: dict[str, str] | None = None, timeout: float,
             max_bytes: int = MAX_BODY_BYTES) -> Answer:
    """POST `data` (GET without it) to `url` and read the whole answer, all within `timeout` seconds.

    Raises DeadlinePassed past the deadline; OSError or `http.client.HTTPException` when the exchange fails otherwise
    (refused, reset, a body cut short); ValueError for a URL that is not http(s) or a body over `max_bytes`."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s) URL")
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
        connection.request("POST" if data is not None else "GET", path, body=data, headers=headers or {})
        response = connection.getresponse()
        body = bytearray()
        while chunk := response.read(1 << 16):
            body += chunk
            if expired.is_set():
                raise DeadlinePassed
            if len(body) > max_bytes:
                raise ValueError(f"{url}: an answer over {max_bytes >> 20} MiB")
        if expired.is_set():
            raise DeadlinePassed
        if response.length:  # the server closed before the length it announced (http.client does not say)
            raise http.client.IncompleteRead(bytes(body), response.length)
        return Answer(response.status, response.reason, bytes(body))
    except (OSError, http.client.HTTPException) as exc:
        if expired.is_set() or isinstance(exc, TimeoutError):
            raise DeadlinePassed(f"no whole answer within {timeout:g} s") from None
        raise
    finally:
        timer.cancel()
        connection.close()

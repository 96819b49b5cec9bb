"""One HTTP exchange within one deadline (`pipeline.deadline_http`): a server that trickles its headers or its body is
cut off at the deadline, not at a socket timeout per byte; a body shorter than announced is an error."""
from __future__ import annotations

import http.client
import socket
import threading
import time

import pytest

from pipeline.deadline_http import DeadlinePassed, exchange


def serve_once(answer: bytes, per_byte_s: float = 0.0, at_once: int = 0) -> str:
    """A one-connection server on 127.0.0.1 that reads the request and writes `answer`: its first `at_once` bytes,
    then a byte per `per_byte_s`."""
    listener = socket.create_server(("127.0.0.1", 0))

    def run():
        connection, _ = listener.accept()
        with connection, listener:
            connection.recv(65536)
            try:
                connection.sendall(answer[:at_once] if per_byte_s else answer)
                for i in range(at_once, len(answer) if per_byte_s else 0):
                    connection.sendall(answer[i:i + 1])
                    time.sleep(per_byte_s)
            except OSError:
                pass

    threading.Thread(target=run, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}/x"


def test_a_whole_answer_comes_back():
    url = serve_once(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok")
    answer = exchange(url, data=b"{}", timeout=5)
    assert (answer.status, answer.body) == (200, b"ok")


@pytest.mark.parametrize("where", ["headers", "body"])
def test_a_trickle_is_cut_off_at_the_deadline(where):
    head, body = b"HTTP/1.0 200 OK\r\nContent-Length: 100\r\n\r\n", b"x" * 100
    url = serve_once(head + body, per_byte_s=0.2, at_once=0 if where == "headers" else len(head))
    start = time.monotonic()
    with pytest.raises(DeadlinePassed, match="no whole answer within 1 s"):
        exchange(url, timeout=1.0)
    assert time.monotonic() - start < 1.5


def test_a_body_shorter_than_announced_is_an_error():
    url = serve_once(b"HTTP/1.0 200 OK\r\nContent-Length: 10\r\n\r\nshort")
    with pytest.raises(http.client.IncompleteRead):
        exchange(url, timeout=5)

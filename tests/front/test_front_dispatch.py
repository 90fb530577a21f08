"""The compiled front's dispatched requests (rust/front/dispatch.rs), driven directly.

With `dispatch=True` the front keeps the connection of a request Python answers: the request
(method, target, headers, body) arrives through `take_requests`, the reply goes back through
the `DispatchedRequest`, whole or in parts with flow control. These tests play Python's
part by hand, so each rule is seen on the wire: framing, keep-alive, pipelining, a client
that stops reading or leaves, a reply that is cut, bad replies refused.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from support.front_sockets import (
    CHAT,
    LIVENESS,
    Front,
    Reader,
    Upstream,
    fronts_of,
    get,
    post,
)


class DispatchFront(Front):
    """A front with dispatch on; `next_request` plays the Python loop."""

    def __init__(self, upstreams: list[str], **overrides: Any) -> None:
        super().__init__(upstreams, dispatch=True, **overrides)
        self.pending: list[Any] = []
        self.writable: list[int] = []

    def _poll(self, deadline: float) -> None:
        select.select([self.wake_r], [], [], max(0.0, deadline - time.monotonic()))
        with contextlib.suppress(BlockingIOError):
            os.read(self.wake_r, 4096)
        self.pending += self.core.take_requests()
        self.writable += self.core.take_writable()

    def next_request(self) -> Any:
        deadline = time.monotonic() + LIVENESS
        while not self.pending:
            assert time.monotonic() < deadline, "no request was dispatched"
            self._poll(deadline)
        return self.pending.pop(0)

    def wait_writable(self, request_id: int) -> None:
        deadline = time.monotonic() + LIVENESS
        while request_id not in self.writable:
            assert time.monotonic() < deadline, "no writable wake-up"
            self._poll(deadline)
        self.writable.remove(request_id)


@pytest.fixture
def make_front() -> Iterator[Callable[..., DispatchFront]]:
    with fronts_of(DispatchFront) as make:
        yield make


@pytest.fixture
def front(upstream: Upstream, make_front: Callable[..., DispatchFront]) -> DispatchFront:
    return make_front([upstream.url])


def test_a_session_turn_reaches_python_as_a_request(front: DispatchFront) -> None:
    client = front.connect()
    body = b'{"messages": []}'
    client.sendall(post(CHAT + "?trace=1", body, "X-Session-ID: s1", "X-Extra: caf\xe9"))
    request = front.next_request()
    assert (request.method, request.target, request.body) == ("POST", CHAT + "?trace=1", body)
    # Names lowercased, values as latin-1 text: what the ASGI server gives the app.
    assert request.headers == [
        ("host", "front"),
        ("x-session-id", "s1"),
        ("x-extra", "caf\xe9".encode().decode("latin-1")),  # sent as UTF-8 bytes
        ("content-length", str(len(body))),
    ]
    assert request.connected
    assert request.reply(200, [("content-type", "application/json")], b'{"ok":true}')
    status, headers, reply = Reader(client).response()
    assert (status, reply) == (200, b'{"ok":true}')
    assert headers == {"content-type": "application/json", "content-length": "11"}
    assert front.stats()["handoffs"] == 0
    assert front.stats()["requests"] == {}  # the front's own counters are for its proxying


def test_the_connection_stays_with_the_front(front: DispatchFront, upstream: Upstream) -> None:
    client = front.connect()
    reader = Reader(client)
    for turn in range(3):
        client.sendall(post(CHAT, b"{}", "X-Session-ID: s1"))
        front.next_request().reply(200, [], f"turn {turn}".encode())
        assert reader.response()[::2] == (200, f"turn {turn}".encode())
        # A stateless request on the same connection is still the front's own.
        client.sendall(get("/v1/models"))
        assert reader.response()[0] == 200
    assert len(upstream.seen) == 3
    assert front.stats()["handoffs"] == 0


def test_pipelined_requests_are_answered_in_order(front: DispatchFront) -> None:
    client = front.connect()
    client.sendall(get("/health") + post("/sessions", b"{}") + get("/metrics"))
    reader = Reader(client)
    for expected in ("/health", "/sessions", "/metrics"):
        request = front.next_request()
        assert request.target == expected
        request.reply(200, [], expected.encode())
        assert reader.response()[::2] == (200, expected.encode())


def test_a_streamed_reply_is_chunked_part_by_part(front: DispatchFront) -> None:
    client = front.connect()
    client.sendall(post(CHAT, b"{}", "X-Session-ID: s1"))
    request = front.next_request()
    assert request.start(200, [("content-type", "text/event-stream")])
    reader = Reader(client)
    status, headers, _ = reader.head()
    assert status == 200
    assert dict(headers)["transfer-encoding"] == "chunked"
    for event in (b"data: 1\n\n", b"data: 2\n\n"):
        assert request.send(event) == 0
        assert reader.chunk() == event  # each part goes out as it comes
    assert request.end()
    assert reader.chunk() == b""
    # The connection carries the next request.
    client.sendall(get("/health"))
    front.next_request().reply(204, [], b"")
    assert reader.response()[0] == 204


def test_a_declared_length_frames_a_streamed_reply(front: DispatchFront) -> None:
    client = front.connect()
    client.sendall(get("/sessions/s1"))
    request = front.next_request()
    request.start(200, [("content-length", "10"), ("connection", "keep-alive")])
    request.send(b"01234")
    request.send(b"56789")
    request.end()
    status, headers, body = Reader(client).response()
    assert (status, body) == (200, b"0123456789")
    assert "transfer-encoding" not in headers and "connection" not in headers


def test_a_reply_that_says_close_closes(front: DispatchFront) -> None:
    client = front.connect()
    client.sendall(get("/health"))
    front.next_request().reply(408, [("connection", "close")], b"{}")
    reader = Reader(client)
    status, headers, _ = reader.response()
    assert (status, headers["connection"]) == (408, "close")
    assert reader.at_eof()


def test_a_client_that_stops_reading_holds_python_back(front: DispatchFront) -> None:
    client = front.connect()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    client.sendall(get("/sessions/big"))
    request = front.next_request()
    request.start(200, [])
    part = bytes(range(256)) * 256  # 64 KiB
    sent = 0
    while (state := request.send(part)) == 0:
        sent += 1
        assert sent < 200, "the queue never filled"
    assert state == 1  # FULL: sent, and Python must wait
    sent += 1
    # Reading drains the queue; the front says so, and Python goes on.
    reader = Reader(client)
    reader.head()
    received = 0
    while received < (sent - 4) * len(part):
        received += len(reader.chunk())
    front.wait_writable(request.id)
    assert request.send(part) in (0, 1)
    sent += 1
    request.end()
    while chunk := reader.chunk():
        received += len(chunk)
    assert received == sent * len(part)


def test_a_client_gone_before_the_reply(front: DispatchFront) -> None:
    client = front.connect()
    client.sendall(post(CHAT, b"{}", "X-Session-ID: s1"))
    request = front.next_request()
    client.close()
    deadline = time.monotonic() + LIVENESS
    while request.connected:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert request.reply(200, [], b"late") is False
    front.wait_until(lambda s: s["connections"] == 0)


def test_a_client_gone_mid_stream_answers_gone(front: DispatchFront) -> None:
    client = front.connect()
    client.sendall(get("/sessions/s1"))
    request = front.next_request()
    request.start(200, [])
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    client.close()  # a reset: the next writes fail
    deadline = time.monotonic() + LIVENESS
    while (state := request.send(b"x" * 4096)) != -1:
        assert time.monotonic() < deadline, state
        time.sleep(0.01)
    assert not request.connected
    front.wait_until(lambda s: s["connections"] == 0)


@pytest.mark.parametrize("how", ["abort", "drop"])
def test_a_cut_reply_closes_the_connection(front: DispatchFront, how: str) -> None:
    client = front.connect()
    client.sendall(get("/sessions/s1"))
    request = front.next_request()
    request.start(200, [])
    request.send(b"partial")
    if how == "abort":
        request.abort()
    else:
        del request  # Python let go of it without an end
    reader = Reader(client)
    reader.head()
    assert reader.chunk() == b"partial"
    # No terminating chunk: the client cannot take the reply as whole.
    with pytest.raises((EOFError, ConnectionResetError)):
        reader.chunk()


def test_a_request_dropped_without_a_reply_closes(front: DispatchFront) -> None:
    client = front.connect()
    client.sendall(get("/health"))
    front.next_request()  # and dropped
    assert Reader(client).at_eof()


def test_bad_replies_are_refused(front: DispatchFront) -> None:
    client = front.connect()
    client.sendall(get("/health"))
    request = front.next_request()
    with pytest.raises(ValueError, match="send\\(\\) or end\\(\\) before start"):
        request.send(b"x")
    with pytest.raises(ValueError, match="invalid HTTP status"):
        request.reply(42, [], b"")
    with pytest.raises(ValueError, match="invalid reply header value"):
        request.reply(200, [("x-bad", "a\r\nb")], b"")
    with pytest.raises(ValueError, match="invalid reply header name"):
        request.reply(200, [("bad name", "v")], b"")
    with pytest.raises(ValueError, match="not latin-1"):
        request.reply(200, [("x-text", "\u20ac")], b"")
    assert request.reply(200, [], b"ok")
    with pytest.raises(ValueError, match="already started"):
        request.reply(200, [], b"again")
    assert Reader(client).response()[::2] == (200, b"ok")


@pytest.mark.parametrize(
    "raw",
    [
        b"HEAD /health HTTP/1.1\r\nHost: f\r\n\r\n",
        b"GET /docs HTTP/1.1\r\nHost: f\r\n\r\n",
        b"PUT /sessions/a HTTP/1.1\r\nHost: f\r\nContent-Length: 0\r\n\r\n",
        b"GET /health HTTP/1.0\r\n\r\n",
        b"POST /sessions HTTP/1.1\r\nHost: f\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b'GET /sessions/a"b HTTP/1.1\r\nHost: f\r\n\r\n',
    ],
)
def test_what_only_the_python_server_handles_is_handed_off(
    front: DispatchFront, raw: bytes
) -> None:
    client = front.connect()
    client.sendall(raw)
    _, data = front.wait_handoff()
    assert raw.startswith(data)
    assert front.core.take_requests() == []


def test_a_wrong_key_is_handed_off_even_for_python_routes(
    upstream: Upstream, make_front: Callable[..., DispatchFront]
) -> None:
    front = make_front([upstream.url], api_key="k")
    client = front.connect()
    client.sendall(post(CHAT, b"{}", "X-Session-ID: s", "Authorization: Bearer nope"))
    front.wait_handoff()
    client2 = front.connect()
    client2.sendall(post(CHAT, b"{}", "X-Session-ID: s", "Authorization: Bearer k"))
    request = front.next_request()
    # The key reaches Python, which strips it before anything goes upstream (asgi.py).
    assert ("authorization", "Bearer k") in request.headers


def test_stop_waits_for_a_dispatched_request(front: DispatchFront) -> None:
    client = front.connect()
    client.sendall(post(CHAT, b"{}", "X-Session-ID: s1"))
    request = front.next_request()
    import threading

    stopper = threading.Thread(target=front.core.stop, args=(LIVENESS,))
    stopper.start()
    time.sleep(0.05)
    assert request.reply(200, [], b"done")
    stopper.join(LIVENESS)
    assert not stopper.is_alive()
    status, headers, body = Reader(client).response()
    # Stopping: the reply says the connection closes.
    assert (status, body, headers.get("connection")) == (200, b"done", "close")

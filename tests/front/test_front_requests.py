"""front/dispatched.py: the Python side of the compiled front's dispatched requests.

A real `CompiledFront` (dispatch on) on a loopback socket, its wake-up pipe read by this
test's event loop as the gateway's is, and a `GatewayApp` whose handler is scripted: what
reaches the app, and what the client gets back for whole replies, streams, a client that
reads slowly or leaves, and replies the front refuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from sessiongate._core import CompiledFront
from sessiongate.front.asgi import FrontendSettings, GatewayApp
from sessiongate.front.dispatched import DispatchedRequests
from sessiongate.protocol import CoreReply, CoreRequest
from support.front_sockets import LIVENESS, Reader, Upstream, get, post

Handler = Callable[[CoreRequest], Awaitable[CoreReply]]


class Harness:
    """The front plus `DispatchedRequests` on the running loop; clients in threads."""

    def __init__(self, handler: Handler, upstream: Upstream) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.front = CompiledFront(
            self.listener.fileno(),
            self.wake_w,
            [upstream.url],
            max_body_bytes=1 << 20,
            api_key=None,
            session_headers=["X-Session-ID"],
            header_timeout=5.0,
            body_timeout=5.0,
            keepalive_timeout=5.0,
            upstream_timeout=LIVENESS,
            connect_timeout=2.0,
            threads=2,
            latency_buckets=[0.1, 1.0],
            dispatch=True,
        )
        self.requests = DispatchedRequests(GatewayApp(handler, FrontendSettings()))
        self.sockets: list[socket.socket] = []
        asyncio.get_running_loop().add_reader(self.wake_r, self._on_wake)

    def _on_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.wake_r, 4096):
                pass
        self.requests.writable(self.front.take_writable())
        self.requests.serve(self.front.take_requests())

    def connect(self) -> socket.socket:
        sock = socket.create_connection(self.listener.getsockname(), timeout=LIVENESS)
        self.sockets.append(sock)
        return sock

    async def close(self) -> None:
        asyncio.get_running_loop().remove_reader(self.wake_r)
        for sock in self.sockets:
            sock.close()
        await asyncio.to_thread(self.front.stop, 1.0)
        await self.requests.drain(1.0)
        for fd in (self.wake_r, self.wake_w):
            os.close(fd)
        self.listener.close()


def run(
    handler: Handler, client: Callable[[Harness], Any], upstream: Upstream
) -> tuple[Any, Harness]:
    """Serve with `handler` while `client(harness)` runs in a thread; its result."""

    async def main() -> tuple[Any, Harness]:
        harness = Harness(handler, upstream)
        try:
            result = await asyncio.wait_for(asyncio.to_thread(client, harness), LIVENESS)
        finally:
            await harness.close()
        return result, harness

    return asyncio.run(main())


def test_a_request_reaches_the_app_as_the_asgi_server_would_give_it(upstream: Upstream) -> None:
    seen: list[CoreRequest] = []

    async def handler(request: CoreRequest) -> CoreReply:
        seen.append(request)
        return CoreReply(201, [("content-type", "application/json"), ("x-a", "b")], b'{"ok":1}')

    def client(h: Harness) -> Any:
        sock = h.connect()
        sock.sendall(post("/sessions/a%2Fb/v1/chat/completions?x=1", b'{"m":1}', "X-T: v"))
        return Reader(sock).response()

    (status, headers, body), _ = run(handler, client, upstream)
    assert (status, body, headers["x-a"]) == (201, b'{"ok":1}', "b")
    (request,) = seen
    assert (request.op, request.session_id) == ("chat", "a/b")
    assert request.path == "/sessions/a%2Fb/v1/chat/completions"  # raw, as under ASGI
    assert (request.query, request.body) == ("x=1", b'{"m":1}')
    assert ("x-t", "v") in request.headers


def test_errors_are_the_app_s_json_errors(upstream: Upstream) -> None:
    async def handler(request: CoreRequest) -> CoreReply:
        raise AssertionError("not reached")

    def client(h: Harness) -> Any:
        sock = h.connect()
        sock.sendall(post("/health", b""))  # 405: classify refuses it
        reader = Reader(sock)
        first = reader.response()
        sock.sendall(get("/sessions/%zz"))  # 400: a bad escape
        return first, reader.response()

    (first, second), _ = run(handler, client, upstream)
    assert first[0] == 405 and b"not allowed on /health" in first[2]
    assert second[0] == 400 and b"percent-encoding" in second[2]


def test_a_reply_the_front_refuses_is_a_500(upstream: Upstream) -> None:
    async def handler(request: CoreRequest) -> CoreReply:
        return CoreReply(200, [("x-bad", "a\r\nb")], b"never")

    def client(h: Harness) -> Any:
        sock = h.connect()
        sock.sendall(get("/sessions/s"))
        return Reader(sock).response()

    (status, _, body), _ = run(handler, client, upstream)
    assert status == 500 and b"invalid reply" in body


def _parts(count: int, size: int, log: list[int]) -> AsyncIterator[bytes]:
    async def parts() -> AsyncIterator[bytes]:
        for index in range(count):
            log.append(index)
            yield bytes([index % 256]) * size

    return parts()


PARTS = 256  # of 64 KiB


def test_a_stream_waits_for_a_slow_reader_and_arrives_whole(upstream: Upstream) -> None:
    made: list[int] = []

    async def handler(request: CoreRequest) -> CoreReply:
        return CoreReply(200, [], stream=_parts(PARTS, 64 << 10, made), coalesce=True)

    def client(h: Harness) -> Any:
        sock = h.connect()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        sock.sendall(get("/sessions/s"))
        reader = Reader(sock)
        reader.head()
        # Nothing read yet: past the kernel's socket buffers (a few MiB on loopback) and the
        # front's 1 MiB queue, the app is held back well before its 16 MiB.
        time.sleep(0.3)
        held_at = len(made)
        received = b"".join(iter(reader.chunk, b""))
        return held_at, received

    (held_at, received), _ = run(handler, client, upstream)
    assert held_at < PARTS // 2
    assert received == b"".join(bytes([i % 256]) * (64 << 10) for i in range(PARTS))
    assert len(made) == PARTS


@pytest.mark.parametrize(("coalesce", "runs_to_the_end"), [(True, False), (False, True)])
def test_a_client_leaving_stops_a_bulk_stream_but_not_a_live_one(
    upstream: Upstream, coalesce: bool, runs_to_the_end: bool
) -> None:
    made: list[int] = []
    closed = asyncio.Event()

    async def handler(request: CoreRequest) -> CoreReply:
        async def parts() -> AsyncIterator[bytes]:
            try:
                for index in range(200):
                    made.append(index)
                    await asyncio.sleep(0.005)
                    yield b"x" * 1024
            finally:
                closed.set()

        return CoreReply(200, [], stream=parts(), coalesce=coalesce)

    def client(h: Harness) -> Any:
        sock = h.connect()
        sock.sendall(get("/sessions/s"))
        Reader(sock).head()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.close()  # a reset: the front's next write fails
        deadline = time.monotonic() + LIVENESS
        while not closed.is_set():
            assert time.monotonic() < deadline
            time.sleep(0.01)

    run(handler, client, upstream)
    # A records dump nobody reads stops; a session turn's SSE runs on, so it is recorded.
    assert (len(made) == 200) is runs_to_the_end

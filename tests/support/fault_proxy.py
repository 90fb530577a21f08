"""A fault-injecting HTTP/1.1 proxy for chaos tests (`benches/stress/chaos.py`, `test_chaos.py`).

It sits between the gateway's workers and the mock engine on loopback and applies its current
`mode` to each *request* (not each connection: the gateway keeps upstream connections alive,
so a per-connection mode would let pooled connections dodge a fault):

- `pass`: forward the request, relay the reply.
- `reset`: read the request, then close with SO_LINGER 0 (the client sees a TCP reset).
- `truncate`: forward the request, relay the reply head and half its body, then close.
- `stall`: read the request and never answer (until the client gives up and closes).
- `http500`, `http503`, `http429`: answer that status with a JSON error body, never reaching
  the engine.

`script(*modes)` queues modes for the next requests, one each, before `mode` applies again;
with `spare_probes`, the gateways' probes (`GET /health`, the engine registry's model and
server info) always pass and are not counted (a fault of the requests alone, as an engine
that is healthy but refuses work).

It runs its own event loop in a daemon thread so both sync tests and the asyncio bench can
switch modes (`proxy.mode = "reset"`) while the gateway's load keeps flowing.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections import Counter

MODES = ("pass", "reset", "truncate", "stall", "http500", "http503", "http429")
# What gateways ask on a timer (health checks, the engine registry's probes): spared by
# `spare_probes`, so scripted modes meet only the requests a test sends.
_PROBES = [
    [b"GET", path]
    for path in (
        b"/health",
        b"/ready",
        b"/model_info",
        b"/get_model_info",
        b"/server_info",
        b"/get_server_info",
    )
]
_STATUS_LINES = {
    "http500": b"500 Internal Server Error",
    "http503": b"503 Service Unavailable",
    "http429": b"429 Too Many Requests",
}
HEAD_END = b"\r\n\r\n"
_ERROR_BODY = b'{"error": "injected upstream failure"}'


class _Closed(Exception):
    """The peer closed before a whole message arrived."""


def _content_length(head: bytes) -> int | None:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return None


async def _read_message(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One HTTP message (head, body) framed by Content-Length; requests without one have
    no body (the gateway's upstream client always sends a length with a body)."""
    try:
        head = await reader.readuntil(HEAD_END)
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise _Closed from exc
    length = _content_length(head)
    if length is None:
        return head, b""
    try:
        body = await reader.readexactly(length)
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise _Closed from exc
    return head, body


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        # Linger 0: close() sends RST instead of FIN, as a crashing engine's kernel would.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultProxy:
    def __init__(self, upstream_port: int, host: str = "127.0.0.1") -> None:
        self.upstream = (host, upstream_port)
        self.host = host
        self.port = 0
        self.mode = "pass"
        # Requests seen per mode: tests assert a fault was actually exercised.
        self.counts: Counter[str] = Counter()
        # Requests seen (probes spared by `spare_probes` not counted).
        self.requests = 0
        self.spare_probes = False
        self._queued: list[str] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; one of {MODES}")
        self.mode = mode

    def script(self, *modes: str) -> None:
        """The next requests get these modes, one each, then `mode` again."""
        for mode in modes:
            if mode not in MODES:
                raise ValueError(f"unknown mode {mode!r}; one of {MODES}")
        self._queued.extend(modes)

    def start(self) -> FaultProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)
        return self

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        if not self._thread.is_alive():
            return

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for writer in list(self._writers):
                writer.transport.abort()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                head, body = await _read_message(reader)
                if self.spare_probes and head.split(b" ", 2)[:2] in _PROBES:
                    mode = "pass"
                else:
                    mode = self._queued.pop(0) if self._queued else self.mode
                    self.counts[mode] += 1
                    self.requests += 1
                if mode == "reset":
                    _reset(writer)
                    return
                if mode == "stall":
                    # Hold the request unanswered until the client gives up (its timeout).
                    await reader.read()
                    return
                if mode in _STATUS_LINES:
                    writer.write(
                        b"HTTP/1.1 "
                        + _STATUS_LINES[mode]
                        + b"\r\ncontent-type: application/json"
                        + f"\r\ncontent-length: {len(_ERROR_BODY)}\r\n\r\n".encode()
                        + _ERROR_BODY
                    )
                    await writer.drain()
                    continue
                if upstream is None:
                    try:
                        upstream = await asyncio.open_connection(*self.upstream)
                    except OSError:
                        # Engine gone: what the gateway would see as a dropped connection.
                        _reset(writer)
                        return
                up_reader, up_writer = upstream
                up_writer.write(head + body)
                await up_writer.drain()
                reply_head, reply_body = await _read_message(up_reader)
                if mode == "truncate":
                    writer.write(reply_head + reply_body[: len(reply_body) // 2])
                    await writer.drain()
                    writer.close()
                    return
                writer.write(reply_head + reply_body)
                await writer.drain()
        except (_Closed, ConnectionError, OSError):
            pass
        finally:
            self._writers.discard(writer)
            if upstream is not None:
                upstream[1].transport.abort()
            if not writer.transport.is_closing():
                writer.close()

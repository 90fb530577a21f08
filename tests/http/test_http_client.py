"""The driver's HTTP/1.1 client against a scripted loopback server (framing, keep-alive)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from sessiongate.http.client import ConnectFailed, HttpClient, ProtocolFailure
from sessiongate.loadgen.http import exchange

# What the server sends for the n-th request it reads (0-based, over all connections), and
# whether it closes the connection afterwards.
Script = Callable[[int], tuple[bytes, bool]]


class ScriptedServer:
    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: list[bytes] = []
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> ScriptedServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                index = len(self.requests)
                self.requests.append(head + body)
                reply, close = self.script(index)
                if reply:
                    writer.write(reply)
                    await writer.drain()
                if close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def _ok(body: bytes, extra: str = "") -> bytes:
    return f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


def _chunked(*parts: bytes) -> bytes:
    out = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    for part in parts:
        out += f"{len(part):x};ext=1\r\n".encode() + part + b"\r\n"
    return out + b"0\r\nX-Trailer: t\r\n\r\n"


async def _get(client: HttpClient, url: str, **kw: Any) -> tuple[int, bytes]:
    async with client.request("POST", url + "/x", body=b'{"a":1}', **kw) as response:
        return response.status, await response.read()


def test_content_length_and_keep_alive():
    async def main() -> None:
        async with ScriptedServer(lambda n: (_ok(b"hello %d" % n), False)) as server:
            client = HttpClient()
            assert await _get(client, server.url) == (200, b"hello 0")
            assert await _get(client, server.url, headers={"X-K": "v"}) == (200, b"hello 1")
            await client.aclose()
            assert server.connections == 1
            first = server.requests[0]
            assert first.startswith(b"POST /x HTTP/1.1\r\n")
            assert b"Content-Length: 7\r\n" in first and first.endswith(b'{"a":1}')
            assert b"X-K: v\r\n" in server.requests[1]

    asyncio.run(main())


def test_chunked_body_with_trailers_then_reuse():
    async def main() -> None:
        reply = _chunked(b"data: 1\n\n", b"data: [DONE]\n\n")
        async with ScriptedServer(lambda n: (reply, False)) as server:
            client = HttpClient()
            for _ in range(2):
                async with client.request("GET", server.url + "/s") as response:
                    chunks = [c async for c in response.iter_raw()]
                assert b"".join(chunks) == b"data: 1\n\ndata: [DONE]\n\n"
            await client.aclose()
            assert server.connections == 1

    asyncio.run(main())


def test_body_until_close_and_204_without_body():
    def script(n: int) -> tuple[bytes, bool]:
        if n == 0:
            return b"HTTP/1.1 204 No Content\r\n\r\n", False
        return b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil eof", True

    async def main() -> None:
        async with ScriptedServer(script) as server:
            client = HttpClient()
            assert await _get(client, server.url) == (204, b"")
            assert await _get(client, server.url) == (200, b"until eof")  # reuses the 204's
            assert await _get(client, server.url) == (200, b"until eof")  # needs a new one
            await client.aclose()
            assert server.connections == 2

    asyncio.run(main())


def test_idle_connection_closed_by_the_server_is_retried_once():
    # The server closes every connection after answering, without saying so.
    async def main() -> None:
        async with ScriptedServer(lambda n: (_ok(b"r%d" % n), True)) as server:
            client = HttpClient()
            assert await _get(client, server.url) == (200, b"r0")
            await asyncio.sleep(0.05)  # let the close arrive, or not: both paths must work
            assert await _get(client, server.url) == (200, b"r1")
            await client.aclose()
            assert server.connections == 2

    asyncio.run(main())


def test_truncated_body_and_refused_connection_are_transport_errors():
    truncated = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort"

    async def main() -> None:
        async with ScriptedServer(lambda n: (truncated, True)) as server:
            client = HttpClient()
            with pytest.raises(ProtocolFailure, match="95 of 100"):
                await _get(client, server.url)
            ex = await exchange(client, "chat", "POST", server.url + "/c", body=b"{}")
            assert (ex.status, ex.error_key) == (200, "protocol")
            url = server.url
        with pytest.raises(ConnectFailed):
            await _get(client, url)
        ex = await exchange(client, "create", "POST", url + "/sessions")
        assert ex.error_key == "connect" and ex.status is None
        await client.aclose()

    asyncio.run(main())


def test_a_silent_server_times_out():
    async def main() -> None:
        async with ScriptedServer(lambda n: (b"", False)) as server:
            client = HttpClient()
            ex = await exchange(client, "chat", "POST", server.url + "/c", body=b"{}", timeout=0.2)
            assert ex.error_key == "timeout" and ex.status is None
            await client.aclose()

    asyncio.run(main())


def test_large_body_is_received_whole_as_bytes_then_reused():
    body = bytes(range(256)) * (5 * 4096 + 3)  # ~5 MiB: many receives into one sink

    async def main() -> None:
        async with ScriptedServer(lambda n: (_ok(body), False)) as server:
            client = HttpClient()
            for _ in range(2):
                status, data = await _get(client, server.url)
                assert status == 200 and type(data) is bytes and data == body
            await client.aclose()
            assert server.connections == 1

    asyncio.run(main())


def test_a_large_body_waits_in_the_socket_while_its_buffer_is_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # While a large body's buffer is made off the loop, the rest of the body stays in the
    # socket: received into the staging buffer meanwhile, it would be copied twice more.
    from sessiongate.http import client as client_module

    body = bytes(range(256)) * (20 * 4096)  # 20 MiB, written at once
    peak = 0
    updated = client_module._Connection.buffer_updated

    def spy(self: client_module._Connection, nbytes: int) -> None:
        nonlocal peak
        updated(self, nbytes)
        peak = max(peak, len(self._buffered))

    monkeypatch.setattr(client_module._Connection, "buffer_updated", spy)

    async def main() -> None:
        async with ScriptedServer(lambda n: (_ok(body), False)) as server:
            client = HttpClient()
            for _ in range(2):  # reading resumes: the connection is reused
                status, data = await _get(client, server.url)
                assert status == 200 and data == body
            await client.aclose()
            assert server.connections == 1

    asyncio.run(main())
    # Only what came with the head (a receive or two); without the hold, BUFFER_LIMIT (2 MiB).
    assert peak < client_module.BUFFER_LIMIT // 2


def test_bytes_after_the_body_retire_the_connection():
    # A server that sends more than it declared has broken the exchange: the extra bytes must
    # never be read as the next response.
    async def main() -> None:
        reply = _ok(b"ok") + b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nevil"
        async with ScriptedServer(lambda n: (reply, False)) as server:
            client = HttpClient()
            assert await _get(client, server.url) == (200, b"ok")
            await asyncio.sleep(0.05)
            assert await _get(client, server.url) == (200, b"ok")
            await client.aclose()
            assert server.connections == 2

    asyncio.run(main())


def test_truncated_large_body_header_overflow_and_bad_chunk_are_protocol_failures():
    big = b"x" * (1 << 20)
    cases = {
        0: (b"HTTP/1.1 200 OK\r\nContent-Length: 3145728\r\n\r\n" + big, True),
        1: (b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (2 << 20) + b"\r\n\r\n", True),
        2: (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcXY0\r\n\r\n", True),
    }

    async def main() -> None:
        async with ScriptedServer(lambda n: cases[n]) as server:
            client = HttpClient()
            with pytest.raises(ProtocolFailure, match="2097152 of 3145728 body bytes unread"):
                await _get(client, server.url)
            with pytest.raises(ProtocolFailure, match="header block too large"):
                await _get(client, server.url)
            with pytest.raises(ProtocolFailure, match="chunk"):
                await _get(client, server.url)
            await client.aclose()

    asyncio.run(main())


def test_bodies_over_the_limit_are_refused_before_buffering():
    huge = b"HTTP/1.1 200 OK\r\nContent-Length: 10000000000\r\n\r\nonly this"
    cases = {0: (huge, True), 1: (_chunked(b"a" * 600, b"b" * 600), False), 2: (_ok(b"ok"), False)}

    async def main() -> None:
        async with ScriptedServer(lambda n: cases[n]) as server:
            client = HttpClient(max_body=1000)
            with pytest.raises(ProtocolFailure, match="10000000000 bytes is over the limit"):
                await _get(client, server.url)
            with pytest.raises(ProtocolFailure, match="over the limit of 1000 bytes"):
                await _get(client, server.url)
            assert await _get(client, server.url) == (200, b"ok")
            await client.aclose()

    asyncio.run(main())

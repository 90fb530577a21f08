"""A small HTTP/1.1 client on an asyncio buffered protocol, with keep-alive, for the
upstream pool and the load driver.

Why not httpx: its connection pool rescans every pooled connection for every request;
measured against the mock engine with 1 KiB chats it costs 0.8 ms of CPU per request at
concurrency 1 and 2.1 ms at 32, this client 0.08 ms at both. Both the gateway's workers
and the load driver must stay far cheaper than what they relay or measure.

This client does one thing: send a request with a known body, read the status and headers,
hand the body out as it arrives (Content-Length, chunked, or until close), and keep the
connection for the next request when the exchange completed cleanly. A body of declared
length is received straight into the `bytes` that `read()` returns. Idle connections are
reused LIFO per origin. No proxies, no redirects, no cookies, no compression. Timeouts are
the caller's (`asyncio.timeout` around the exchange).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import select
import ssl
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

from sessiongate.primitives import BytesSink

READ_CHUNK = 256 * 1024
HEADER_LIMIT = 1 << 20  # largest status line + header block accepted
LINE_LIMIT = 64 * 1024  # longest chunk-size or trailer line accepted
# Bytes held unread before the connection stops reading from the socket.
BUFFER_LIMIT = 2 << 20
NO_BODY_STATUSES = frozenset({204, 304})
# Bodies at least this large get their buffer allocated (and its pages faulted) off the loop.
OFF_LOOP_SINK = 1 << 20
# Chunks of chunked bodies up to this size are received whole, like a Content-Length body.
SINK_CHUNK_MAX = 8 << 20
# A reply head ends at an empty line; a bare LF ends a line too (RFC 9112 §2.2 lets a
# recipient accept it, as the compiled front's HTTP client does).
_HEAD_END = re.compile(rb"\r?\n\r?\n")
# Interim (1xx) replies read before giving up on a final one.
MAX_INTERIM = 16
# Methods a request may be sent again with when a reused connection closes without a reply
# (RFC 9110 §9.2.2); any other request is never retried once it may have been sent
# (RFC 9112 §9.3.1): the engine may have acted on it.
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})
# A connection idle for longer is not reused for a non-idempotent request: the engine may be
# closing it right now (uvicorn's keep-alive is 5 s), and such a request cannot be retried.
FRESH_FOR_NON_IDEMPOTENT_S = 2.0


class HttpError(Exception):
    """Transport-level failure: connect, protocol, or the connection dropped."""


class ConnectFailed(HttpError):
    pass


def connect_failed_text(host: str, port: int, why: str) -> str:
    """Why a connection to `host:port` could not be made (`why`: as the OS said). Twinned by
    `rust/front/failure.rs`, so a 502 reads the same whichever front relayed the request."""
    return f"cannot connect to {host}:{port}: {why}"


def connect_timed_out(seconds: float) -> str:
    """`why` of a connection not made within `seconds` (twinned by `failure.rs`)."""
    return f"timed out after {float(seconds)}s"


class ProtocolFailure(HttpError):
    pass


class _NotSent(ConnectionResetError):
    """The connection was closed before any byte of the request was written."""


class _Connection(asyncio.BufferedProtocol):
    """One keep-alive connection: a buffered byte reader on top of the transport.

    Why a protocol rather than asyncio streams: a StreamReader copies every received chunk
    into its buffer, again into the `bytes` it hands out, and the caller joins them (three
    copies of a 20+ MiB reply, measured as most of a gateway worker's CPU per R3 turn). Here
    a body of known length is received straight into its final buffer (`read_into`): the
    kernel's copy is the only one.
    """

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._staging = memoryview(bytearray(READ_CHUNK))
        self._buffered = bytearray()  # received, not yet consumed
        self._sink: memoryview | None = None  # a read_into target still being filled
        self._sink_filled = 0
        self._eof = False
        self._waiter: asyncio.Future[None] | None = None
        self._writable: asyncio.Future[None] | None = None  # set while writing is paused
        self.idle_since = 0.0  # when it went back to the pool (time.monotonic)

    # -- protocol callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports have the Transport methods without subclassing it.
        self._transport = cast(asyncio.Transport, transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._sink is not None:
            return self._sink[self._sink_filled :]
        return self._staging

    def buffer_updated(self, nbytes: int) -> None:
        if self._sink is not None:
            self._sink_filled += nbytes
            if self._sink_filled == len(self._sink):
                self._wake()  # one wake-up per body, not one per receive
            return
        self._buffered += self._staging[:nbytes]
        if len(self._buffered) > BUFFER_LIMIT and self._transport is not None:
            self._transport.pause_reading()  # nobody is reading: stop taking more
        self._wake()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        # Why it was lost does not matter to a reader: a cut body is reported by its length.
        self._eof = True
        self._wake()
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def pause_writing(self) -> None:
        self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None

    # -- reading
    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _wait_data(self) -> None:
        """Until more bytes (or EOF) arrive."""
        if self._eof:
            return
        if self._transport is not None:
            self._transport.resume_reading()
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _take(self, n: int) -> bytes:
        data = bytes(self._buffered[:n])
        del self._buffered[:n]
        return data

    async def readuntil(self, separator: bytes, limit: int) -> bytes:
        """Bytes up to and including `separator`; at EOF, what came (possibly b"")."""
        start = 0
        while (end := self._buffered.find(separator, start)) < 0:
            if len(self._buffered) > limit:
                raise ProtocolFailure(f"no {separator!r} within {limit} bytes")
            if self._eof:
                return self._take(len(self._buffered))
            start = max(0, len(self._buffered) - len(separator) + 1)
            await self._wait_data()
        if end > limit:
            raise ProtocolFailure(f"no {separator!r} within {limit} bytes")
        return self._take(end + len(separator))

    async def read_head(self, limit: int) -> bytes | None:
        """A reply head up to its empty line (excluded); None when the peer closed first
        (what came of the head is dropped: `len` of it is in the error the caller raises)."""
        start = 0
        while (found := _HEAD_END.search(self._buffered, start)) is None:
            if len(self._buffered) > limit:
                raise ProtocolFailure("response header block too large")
            if self._eof:
                return None
            start = max(0, len(self._buffered) - 3)
            await self._wait_data()
        if found.start() > limit:
            raise ProtocolFailure("response header block too large")
        head = bytes(self._buffered[: found.start()])
        del self._buffered[: found.end()]
        return head

    async def read(self, n: int) -> bytes:
        """Up to `n` bytes, as soon as there are some; b"" at EOF."""
        if not self._buffered:
            await self._wait_data()
        return self._take(n)

    async def read_exactly(self, n: int) -> bytes:
        """`n` bytes; fewer only when the peer closed."""
        while len(self._buffered) < n and not self._eof:
            await self._wait_data()
        return self._take(n)

    async def read_into(self, target: memoryview) -> int:
        """Fill `target`; returns how many bytes arrived (fewer only when the peer closed)."""
        filled = min(len(self._buffered), len(target))
        with memoryview(self._buffered) as buffered:  # a slice of it would copy first
            target[:filled] = buffered[:filled]
        del self._buffered[:filled]
        if filled == len(target) or self._eof:
            return filled
        self._sink, self._sink_filled = target, filled
        try:
            while self._sink_filled < len(target) and not self._eof:
                await self._wait_data()
            return self._sink_filled
        finally:
            self._sink = None

    def hold_reading(self) -> None:
        """Leave what arrives in the socket until the next read (a body's buffer being made
        off the loop: received now, it would be copied twice more into it)."""
        if self._transport is not None and not self._eof:
            self._transport.pause_reading()

    # -- writing and state
    async def write(self, data: bytes) -> None:
        if self._transport is None or self._transport.is_closing():
            raise _NotSent("connection closed")
        self._transport.write(data)
        if self._writable is not None:
            await self._writable
            if self._eof:
                raise ConnectionResetError("connection closed while sending")

    def usable(self) -> bool:
        # Bytes nobody asked for mean the peer broke the exchange: never reuse such a line.
        return (
            not self._eof
            and not self._buffered
            and self._transport is not None
            and not self._transport.is_closing()
            and not self._unread_input()
        )

    def _unread_input(self) -> bool:
        """Whether the socket has input the loop has not read yet: on an idle connection
        that is the peer's close (or junk), seen before a request is sent on it rather than
        after (when a POST could no longer be sent again). Plain TCP only: a TLS socket may
        hold protocol records that are no reply."""
        if self._transport is None or self._transport.get_extra_info("sslcontext") is not None:
            return False
        sock = self._transport.get_extra_info("socket")
        if sock is None:
            return False
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        return bool(poller.poll(0))

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


@dataclass(slots=True)
class Response:
    status: int
    headers: dict[str, str]  # lower-case names; repeated headers joined with ", "
    _conn: _Connection
    _length: int | None
    _chunked: bool
    _keep_alive: bool
    _max_body: int | None = None  # largest body `read()` buffers (None: no limit)
    _done: bool = False

    def __post_init__(self) -> None:
        if self._length == 0 and not self._chunked:
            self._done = True  # nothing to read: the connection is ready for reuse

    async def iter_raw(self) -> AsyncIterator[bytes]:
        """The body as it arrives (chunked framing removed); once."""
        if self._done:
            return
        conn = self._conn
        if self._chunked:
            while True:
                line = await conn.readuntil(b"\n", LINE_LIMIT)
                if not line.endswith(b"\n"):
                    raise ProtocolFailure("connection closed inside a chunked body")
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise ProtocolFailure(f"bad chunk size line {line[:40]!r}") from None
                if size == 0:
                    while (await conn.readuntil(b"\n", LINE_LIMIT)) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    break
                if READ_CHUNK <= size <= SINK_CHUNK_MAX:
                    # A large chunk (an SSE event of many MiB arrives as a few) lands whole
                    # in its own bytes, like a Content-Length body.
                    yield await self._read_sized(size, "connection closed inside a chunk")
                else:
                    remaining = size
                    while remaining:
                        data = await conn.read(min(remaining, READ_CHUNK))
                        if not data:
                            raise ProtocolFailure("connection closed inside a chunk")
                        remaining -= len(data)
                        yield data
                if await conn.read_exactly(2) != b"\r\n":
                    raise ProtocolFailure(f"chunk of {size} bytes not followed by CRLF")
        elif self._length is not None:
            remaining = self._length
            while remaining:
                data = await conn.read(min(remaining, READ_CHUNK))
                if not data:
                    raise ProtocolFailure(_unread(remaining, self._length))
                remaining -= len(data)
                yield data
        else:
            while data := await conn.read(READ_CHUNK):
                yield data
        self._done = True

    async def read(self) -> bytes:
        """The whole body; once. A body of declared length is received straight into the
        `bytes` returned (a `BytesSink`): no copy but the kernel's."""
        if self._done:
            return b""
        limit = self._max_body
        if self._chunked or self._length is None:
            chunks: list[bytes] = []
            total = 0
            async for chunk in self.iter_raw():
                total += len(chunk)
                if limit is not None and total > limit:
                    raise ProtocolFailure(f"body over the limit of {limit} bytes")
                chunks.append(chunk)
            return b"".join(chunks)
        if limit is not None and self._length > limit:
            # Refused before anything is allocated: a declared length is not proof of a body.
            raise ProtocolFailure(
                f"declared body of {self._length} bytes is over the limit of {limit} bytes"
            )
        body = await self._read_sized(self._length, None)
        self._done = True
        return body

    async def _read_sized(self, size: int, cut_message: str | None) -> bytes:
        """`size` bytes received straight into a new bytes object (a `BytesSink`)."""
        try:
            if size >= OFF_LOOP_SINK:
                # Fresh memory costs page faults (0.1-0.5 ms per MiB on the dev box, more when
                # a VM must back it): take them in a thread, not in the loop serving others.
                # Meanwhile the body waits in the socket (up to its buffer, then the sender
                # waits), not in the staging buffer: received there, up to BUFFER_LIMIT of it
                # was copied twice more (0.5 ms of an R3 turn's 9). read_into resumes.
                self._conn.hold_reading()
                sink = await asyncio.to_thread(BytesSink, size)
            else:
                sink = BytesSink(size)
        except MemoryError:
            raise ProtocolFailure(f"a body of {size} bytes is too large to buffer") from None
        view = sink.view()
        try:
            received = await self._conn.read_into(view)
        finally:
            view.release()
        if received < size:
            raise ProtocolFailure(cut_message or _unread(size - received, size))
        return sink.finish(size)


def _unread(remaining: int, length: int) -> str:
    return f"connection closed with {remaining} of {length} body bytes unread"


def _parse_head(head: bytes) -> tuple[int, dict[str, str], bool]:
    lines = [line.removesuffix("\r") for line in head.decode("latin-1").split("\n")]
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/"):
        raise ProtocolFailure(f"bad status line {lines[0][:80]!r}")
    try:
        status = int(parts[1])
    except ValueError:
        raise ProtocolFailure(f"bad status line {lines[0][:80]!r}") from None
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise ProtocolFailure(f"bad header line {line[:80]!r}")
        key = name.strip().lower()
        value = value.strip()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return status, headers, parts[0] == "HTTP/1.0"


class HttpClient:
    """Keep-alive HTTP/1.1 requests to any number of origins; `aclose` closes them all."""

    def __init__(
        self,
        *,
        verify_tls: bool = True,
        connect_timeout: float | None = None,
        max_body: int | None = None,
    ) -> None:
        # `Response.read()` refuses bodies over `max_body` bytes (streamed reads are not limited).
        self._max_body = max_body
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        # A connect that hangs (a blackholed address) fails as ConnectFailed after this long.
        self._connect_timeout = connect_timeout
        self._verify_tls = verify_tls
        self._ssl: ssl.SSLContext | None = None  # made on the first https request
        self._closed = False

    def _tls(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
            if not self._verify_tls:
                self._ssl.check_hostname = False
                self._ssl.verify_mode = ssl.CERT_NONE
        return self._ssl

    async def _connect(self, scheme: str, host: str, port: int) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, conn = await loop.create_connection(
                    _Connection, host, port, ssl=self._tls() if scheme == "https" else None
                )
        except TimeoutError as exc:
            limit = self._connect_timeout
            # No limit of ours: the OS gave up (ETIMEDOUT), and says so.
            why = connect_timed_out(limit) if limit is not None else str(exc) or "timed out"
            raise ConnectFailed(connect_failed_text(host, port, why)) from exc
        except OSError as exc:
            raise ConnectFailed(connect_failed_text(host, port, str(exc))) from exc
        return conn

    def _take_idle(
        self, origin: tuple[str, str, int], max_idle: float | None
    ) -> _Connection | None:
        idle = self._idle.get(origin)
        oldest = None if max_idle is None else time.monotonic() - max_idle
        while idle:
            conn = idle.pop()
            if conn.usable() and (oldest is None or conn.idle_since >= oldest):
                return conn
            conn.close()
        return None

    @contextlib.asynccontextmanager
    async def request(
        self,
        method: str,
        url: str,
        *,
        headers: Mapping[str, str] | Iterable[tuple[str, str]] | None = None,
        body: bytes | None = None,
        on_sent: Callable[[], None] | None = None,
    ) -> AsyncIterator[Response]:
        """Send one request; the response's body must be read inside the `async with`.
        `on_sent` is called once the request is written (before its reply is awaited)."""
        parts = urlsplit(url)
        scheme = parts.scheme
        if scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        port = parts.port or (443 if scheme == "https" else 80)
        origin = (scheme, parts.hostname, port)
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        host = parts.hostname if parts.port is None else f"{parts.hostname}:{parts.port}"
        lines = [f"{method} {target} HTTP/1.1", f"Host: {host}"]
        pairs = headers.items() if isinstance(headers, Mapping) else (headers or ())
        lines += [f"{k}: {v}" for k, v in pairs]
        if body is not None or method in ("POST", "PUT", "PATCH"):
            lines.append(f"Content-Length: {len(body or b'')}")
        wire = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")

        idempotent = method in IDEMPOTENT
        conn = self._take_idle(origin, None if idempotent else FRESH_FOR_NON_IDEMPOTENT_S)
        reused = conn is not None
        while True:
            if conn is None:
                conn = await self._connect(*origin)
            try:
                await conn.write(wire)
                if on_sent is not None:
                    on_sent()
                    on_sent = None  # once, whatever retry follows
                head = await self._final_head(conn)
            except _NotSent as exc:
                conn.close()
                if reused:  # closed while idle, and nothing was sent: safe to send it anew
                    conn, reused = None, False
                    continue
                raise ProtocolFailure(f"connection dropped before the request: {exc!r}") from exc
            except OSError as exc:
                conn.close()
                if reused and idempotent:
                    # The server closed an idle keep-alive connection under us: retry once
                    # on a fresh connection.
                    conn, reused = None, False
                    continue
                raise ProtocolFailure(f"connection dropped before the response: {exc!r}") from exc
            except BaseException:
                conn.close()
                raise
            if head is not None:
                break
            conn.close()
            if reused and idempotent:
                conn, reused = None, False  # closed while idle, before answering: retry once
                continue
            raise ProtocolFailure(
                "connection closed before the response"
                + ("" if idempotent else f" (a {method} is never sent twice)")
            )
        status, response_headers, http10 = head
        chunked = "chunked" in response_headers.get("transfer-encoding", "").lower()
        length: int | None = None
        if not chunked and "content-length" in response_headers:
            try:
                length = int(response_headers["content-length"])
            except ValueError:
                conn.close()
                raise ProtocolFailure("bad Content-Length") from None
        if method == "HEAD" or status in NO_BODY_STATUSES:
            length, chunked = 0, False
        connection = response_headers.get("connection", "").lower()
        keep_alive = not http10 and "close" not in connection and (chunked or length is not None)
        response = Response(
            status, response_headers, conn, length, chunked, keep_alive, self._max_body
        )
        try:
            yield response
        except BaseException:
            conn.close()
            raise
        if response._done and keep_alive and not self._closed and conn.usable():
            conn.idle_since = time.monotonic()
            self._idle.setdefault(origin, []).append(conn)
        else:
            conn.close()

    @staticmethod
    async def _final_head(conn: _Connection) -> tuple[int, dict[str, str], bool] | None:
        """The final reply's head, interim (1xx) replies skipped; None when the connection
        closed before one came."""
        for _ in range(MAX_INTERIM):
            raw = await conn.read_head(HEADER_LIMIT)
            if raw is None:
                return None
            head = _parse_head(raw)
            status = head[0]
            if status == 101:
                raise ProtocolFailure(
                    "upstream answered 101 Switching Protocols, but no upgrade was asked for"
                )
            if not 100 <= status < 200:
                return head
        raise ProtocolFailure(f"more than {MAX_INTERIM} interim (1xx) replies")

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()

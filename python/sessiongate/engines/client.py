"""An async HTTP client to one upstream base URL, on the lean keep-alive client.

Transport failures become `UpstreamError` (502) naming the upstream and what failed
(`EngineUnreachable` when the connection could not be made, so nothing was sent); HTTP
statuses are returned as they are, because non-200 replies pass through to the client.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

from sessiongate.errors import UpstreamError
from sessiongate.http.client import ConnectFailed, HttpClient, HttpError, Response
from sessiongate.http.forwarding import forwardable_headers, relayable_reply_headers
from sessiongate.primitives import CachedTokensWatch

# Largest upstream reply a worker buffers, R3 included: ~6x a 128k-token turn of a
# 61-layer top-8 model (250 MB raw, 333 MB of base64). Past it the reply is a 502: a body is
# received into memory allocated up front from its declared length, so that length must be
# believable.
MAX_UPSTREAM_REPLY = 2 << 30
# Upstream replies are relayed verbatim, so never ask for compression.
_IDENTITY = ("accept-encoding", "identity")


def transport_error_text(method: str, url: str, path: str, kind: str, detail: str) -> str:
    """The 502 message of an exchange with an engine that failed below HTTP; `kind` names the
    failure (the exception class: `ConnectFailed`, `TimeoutError`, ...). Twinned by
    `rust/front/failure.rs`: a client reads the same words whichever front relayed it."""
    return f"upstream transport error: {method} {url}{path} failed ({kind}: {detail})"


class EngineTransportError(UpstreamError):
    """The exchange with the upstream failed below HTTP (connect, reset, cut reply, timeout)."""

    def __init__(self, message: str, *, base_url: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.base_url = base_url
        # A timeout says the engine is slow, not that it is gone: the pool leaves the
        # verdict to its health probe instead of marking the upstream down.
        self.timed_out = timed_out


class EngineUnreachable(EngineTransportError):
    """The connection could not be made: nothing was sent, so a retry elsewhere is safe."""

    def __init__(self, message: str, *, base_url: str) -> None:
        super().__init__(message, base_url=base_url)


@dataclass(frozen=True)
class EngineReply:
    status: int
    headers: list[tuple[str, str]]
    body: bytes


@dataclass
class EngineStream:
    """A reply whose body is relayed as it arrives; `aclose()` must be called."""

    status: int
    headers: list[tuple[str, str]]
    response: Response
    exchange: contextlib.AsyncExitStack
    timeout: float
    _closed: bool = field(default=False)
    # Reads the body's cached_tokens on the way when the engine policy learns from it (the
    # pool sets it; engines/pool.py).
    watch: CachedTokensWatch | None = None

    def _seen(self, chunk: bytes) -> None:
        if self.watch is not None and not self.watch.done:
            self.watch.feed(chunk)

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async with asyncio.timeout(self.timeout):
                async for chunk in self.response.iter_raw():
                    self._seen(chunk)
                    yield chunk
        except (HttpError, OSError, TimeoutError):
            # The client already has the status line; ending the body early is all we can do.
            return
        finally:
            await self.aclose()

    async def raw_chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives; a transport failure or timeout raises UpstreamError
        (unlike `chunks`, for a caller that must tell a cut stream from a complete one)."""
        try:
            async with asyncio.timeout(self.timeout):
                async for chunk in self.response.iter_raw():
                    self._seen(chunk)
                    yield chunk
        except (HttpError, OSError, TimeoutError) as exc:
            detail = str(exc) or type(exc).__name__
            raise UpstreamError(f"upstream transport error while streaming: {detail}") from exc

    def is_event_stream(self) -> bool:
        return self.response.headers.get("content-type", "").startswith("text/event-stream")

    def small_body_length(self, limit: int) -> int | None:
        """The declared length when the body is small and not a live stream, else None."""
        if self.is_event_stream():
            return None
        declared = self.response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) <= limit:
            return int(declared)
        return None

    async def read_all(self) -> bytes:
        try:
            async with asyncio.timeout(self.timeout):
                body = await self.response.read()
                self._seen(body)
                return body
        except (HttpError, OSError, TimeoutError) as exc:
            raise UpstreamError(f"upstream transport error while reading the reply: {exc}") from exc
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            await self.exchange.aclose()


class EngineClient:
    def __init__(
        self, base_url: str, *, timeout: float = 600.0, connect_timeout: float = 10.0
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.connect_timeout = min(timeout, connect_timeout)
        self._http = HttpClient(connect_timeout=self.connect_timeout, max_body=MAX_UPSTREAM_REPLY)

    def _error(self, method: str, path: str, exc: BaseException) -> UpstreamError:
        kind = type(exc).__name__
        detail = str(exc) or ("timed out" if isinstance(exc, TimeoutError) else "")
        message = transport_error_text(method, self.base_url, path, kind, detail)
        if isinstance(exc, ConnectFailed):
            return EngineUnreachable(message, base_url=self.base_url)
        return EngineTransportError(
            message, base_url=self.base_url, timed_out=isinstance(exc, TimeoutError)
        )

    async def check(self, path: str = "/health", timeout: float = 2.0) -> str | None:
        """None when the upstream answers `path` with a 2xx in time, else what went wrong."""
        try:
            async with (
                asyncio.timeout(timeout),
                self._http.request("GET", self.base_url + path) as response,
            ):
                await response.read()
        except TimeoutError:
            return f"GET {self.base_url}{path} timed out after {timeout:g}s"
        except (HttpError, OSError) as exc:
            return f"GET {self.base_url}{path} failed ({type(exc).__name__}: {exc})"
        if 200 <= response.status < 300:
            return None
        return f"GET {self.base_url}{path} answered {response.status}"

    async def probe(self, path: str = "/health", timeout: float = 2.0) -> bool:
        """True when the upstream answers `path` with a 2xx in time."""
        return await self.check(path, timeout) is None

    async def post_json(
        self,
        path: str,
        body: bytes,
        headers: Iterable[tuple[str, str]] = (),
        on_sent: Callable[[], None] | None = None,
    ) -> EngineReply:
        all_headers = [("content-type", "application/json"), _IDENTITY, *headers]
        try:
            async with (
                asyncio.timeout(self.timeout),
                self._http.request(
                    "POST", self.base_url + path, headers=all_headers, body=body, on_sent=on_sent
                ) as response,
            ):
                content = await response.read()
        except (HttpError, OSError, TimeoutError) as exc:
            raise self._error("POST", path, exc) from exc
        return EngineReply(
            status=response.status,
            headers=relayable_reply_headers(response.headers.items()),
            body=content,
        )

    async def open_stream(
        self,
        method: str,
        path: str,
        *,
        query: str = "",
        headers: Iterable[tuple[str, str]] = (),
        body: bytes = b"",
        on_sent: Callable[[], None] | None = None,
    ) -> EngineStream:
        url = self.base_url + path + (f"?{query}" if query else "")
        exchange = contextlib.AsyncExitStack()
        try:
            async with asyncio.timeout(self.timeout):
                response = await exchange.enter_async_context(
                    self._http.request(
                        method,
                        url,
                        headers=[_IDENTITY, *forwardable_headers(headers)],
                        body=body or None,
                        on_sent=on_sent,
                    )
                )
        except (HttpError, OSError, TimeoutError) as exc:
            await exchange.aclose()
            raise self._error(method, path, exc) from exc
        except BaseException:
            await exchange.aclose()
            raise
        return EngineStream(
            status=response.status,
            headers=relayable_reply_headers(response.headers.items()),
            response=response,
            exchange=exchange,
            timeout=self.timeout,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

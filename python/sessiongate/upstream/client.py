"""A pooled async HTTP client to one upstream base URL.

Transport failures become `UpstreamError` (502) naming the upstream and what failed; HTTP
statuses are returned as they are, because non-200 replies pass through to the client.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

import httpx

from sessiongate.session.errors import UpstreamError

# Hop-by-hop headers (RFC 9110 section 7.6.1) and ones the client library recomputes.
_DROP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "content-encoding",
        "accept-encoding",
    }
)


def forwardable_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(k, v) for k, v in headers if k.lower() not in _DROP_HEADERS]


class UpstreamUnreachable(UpstreamError):
    """The connection could not be made: nothing was sent, so a retry elsewhere is safe."""

    def __init__(self, message: str, *, base_url: str) -> None:
        super().__init__(message)
        self.base_url = base_url


@dataclass(frozen=True)
class UpstreamReply:
    status: int
    headers: list[tuple[str, str]]
    body: bytes


@dataclass
class UpstreamStream:
    """A reply whose body is relayed as it arrives; `aclose()` must be called."""

    status: int
    headers: list[tuple[str, str]]
    response: httpx.Response

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.response.aiter_raw():
                yield chunk
        except httpx.HTTPError:
            # The client already has the status line; ending the body early is all we can do.
            return
        finally:
            await self.response.aclose()

    async def aclose(self) -> None:
        await self.response.aclose()

    def small_body_length(self, limit: int) -> int | None:
        """The declared length when the body is small and not a live stream, else None."""
        if self.response.headers.get("content-type", "").startswith("text/event-stream"):
            return None
        declared = self.response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) <= limit:
            return int(declared)
        return None

    async def read_all(self) -> bytes:
        try:
            return await self.response.aread()
        except httpx.HTTPError as exc:
            raise UpstreamError(f"upstream transport error while reading the reply: {exc}") from exc
        finally:
            await self.response.aclose()


class UpstreamClient:
    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 600.0,
        max_connections: int = 1024,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
            # Upstream replies are relayed verbatim, so never ask for compression.
            headers={"accept-encoding": "identity"},
        )

    def _error(self, method: str, path: str, exc: Exception) -> UpstreamError:
        kind = type(exc).__name__
        message = f"upstream transport error: {method} {self.base_url}{path} failed ({kind}: {exc})"
        if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
            return UpstreamUnreachable(message, base_url=self.base_url)
        return UpstreamError(message)

    async def probe(self, path: str = "/health", timeout: float = 2.0) -> bool:
        """True when the upstream answers `path` with a 2xx in time."""
        try:
            response = await self._client.get(path, timeout=timeout)
        except httpx.HTTPError:
            return False
        return response.is_success

    async def post_json(
        self, path: str, body: bytes, headers: Iterable[tuple[str, str]] = ()
    ) -> UpstreamReply:
        all_headers = [("content-type", "application/json"), *headers]
        try:
            response = await self._client.post(path, content=body, headers=all_headers)
        except httpx.HTTPError as exc:
            raise self._error("POST", path, exc) from exc
        return UpstreamReply(
            status=response.status_code,
            headers=forwardable_headers(response.headers.items()),
            body=response.content,
        )

    async def open_stream(
        self,
        method: str,
        path: str,
        *,
        query: str = "",
        headers: Iterable[tuple[str, str]] = (),
        body: bytes = b"",
    ) -> UpstreamStream:
        url = path + (f"?{query}" if query else "")
        request = self._client.build_request(
            method, url, content=body or None, headers=forwardable_headers(headers)
        )
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise self._error(method, path, exc) from exc
        return UpstreamStream(
            status=response.status_code,
            headers=forwardable_headers(response.headers.items()),
            response=response,
        )

    async def aclose(self) -> None:
        await self._client.aclose()

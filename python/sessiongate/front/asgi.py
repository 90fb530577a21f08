"""A small raw-ASGI front end: limits, auth, routing, then one handler call per request.

Raw ASGI (not a framework router) because every request takes the same short path and the
front end must never parse request bodies; the handler decides what a body means.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from sessiongate.config.fields import flag_of
from sessiongate.config.front import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_SESSION_HEADERS,
    FrontConfig,
)
from sessiongate.config.gateway import GatewayConfig
from sessiongate.dialects import dialect_of_path, gateway_error_in_dialect
from sessiongate.errors import (
    BodyTimeout,
    GatewayError,
    PayloadTooLarge,
    RouteNotFound,
    Unauthorized,
)
from sessiongate.front.cpu_pressure import yield_to_busy_cpu
from sessiongate.front.routes import DOCS_PATHS, classify, session_header_names
from sessiongate.protocol import (
    CoreReply,
    CoreRequest,
    FilePart,
    LendOffer,
    Op,
    close_stream,
    error_reply,
)

Handler = Callable[[CoreRequest], Awaitable[CoreReply]]
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
# ASGI's type: a mutable mapping, so an app typed to the spec (FastAPI's) can be handed it.
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FrontendSettings:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    api_key: str | None = None
    session_headers: Sequence[str] = DEFAULT_SESSION_HEADERS
    # Read timeouts against slow clients (docs/reliability.md): the header one is enforced
    # by the HTTP protocol (front/http_protocol.py), the body one here, where bodies are read.
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S
    # The key of the engine management routes (`--admin-key`); None: they take `api_key`
    # like every other route (docs/api.md, "Engine management").
    admin_key: str | None = None


def frontend_settings(config: GatewayConfig) -> FrontendSettings:
    """The front end's settings from the front and engines sections (SystemExit naming the
    flag of a value it cannot use)."""
    front = config.front
    if front.max_body_bytes < 1:
        raise SystemExit("--max-body-bytes must be >= 1")
    for flag, value in (
        (flag_of(FrontConfig, "header_timeout"), front.header_timeout),
        (flag_of(FrontConfig, "body_timeout"), front.body_timeout),
    ):
        if not (value > 0 and math.isfinite(value)):
            raise SystemExit(f"{flag} must be a finite number of seconds > 0")
    admin_key = config.engines.admin_key
    if admin_key is not None and not admin_key.strip():
        raise SystemExit("--admin-key must not be empty")
    return FrontendSettings(
        max_body_bytes=front.max_body_bytes,
        api_key=front.api_key or None,
        session_headers=session_header_names(front.session_header),
        header_timeout=front.header_timeout,
        body_timeout=front.body_timeout,
        admin_key=admin_key or None,
    )


async def _read_body(
    receive: Receive, limit: int, declared: int | None, idle_timeout: float
) -> bytes:
    if declared is not None and declared > limit:
        raise PayloadTooLarge(f"request body is {declared} bytes, over the limit of {limit} bytes")
    parts: list[bytes] = []
    size = 0
    while True:
        try:
            # Per chunk, so a large body on a slow but live link is never cut off; only a
            # client that goes quiet (a body shorter than its Content-Length) is.
            async with asyncio.timeout(idle_timeout):
                message = await receive()
        except TimeoutError:
            raise BodyTimeout(f"request body not received within {idle_timeout:g} s") from None
        if message["type"] == "http.disconnect":
            raise ConnectionResetError("client disconnected while sending the body")
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body is over the limit of {limit} bytes")
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


async def send_reply(send: Send, reply: CoreReply, head_only: bool = False) -> None:
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in reply.headers]
    if reply.stream is None:
        headers.append((b"content-length", str(len(reply.body)).encode()))
    if reply.stream is None:
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if head_only else reply.body})
        return
    try:
        # Inside the try: a stream must be closed even when the client is gone before the
        # status line goes out (its cleanup ends an upstream exchange or a session turn).
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        async for part in reply.stream:
            if isinstance(part, LendOffer):  # only the compiled front can lend its connection
                await part.decline()
            elif isinstance(part, FilePart):  # a shared-memory segment of a records GET
                async for chunk in part:
                    await yield_to_busy_cpu()
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            elif part:
                await send({"type": "http.response.body", "body": part, "more_body": True})
    finally:
        await close_stream(reply.stream)
    await send({"type": "http.response.body", "body": b""})


class GatewayApp:
    """ASGI app: turns HTTP requests into `CoreRequest`s for `handler`."""

    def __init__(self, handler: Handler, settings: FrontendSettings | None = None) -> None:
        self.handler = handler
        self.settings = settings or FrontendSettings()
        self._api_key = (
            self.settings.api_key.encode() if self.settings.api_key is not None else None
        )
        self._admin_key = (
            self.settings.admin_key.encode() if self.settings.admin_key is not None else None
        )
        # The FastAPI app of /openapi.json and /docs, built on their first request.
        self._docs_app: Callable[[Scope, Receive, Send], Awaitable[None]] | None = None

    def _check_auth(self, headers: list[tuple[str, str]], op: Op) -> None:
        # Changing the engine set redirects every prompt: with an admin key, only it may
        # (the API key of clients does not); without one, the API key guards it as the rest.
        key, what = (
            (self._admin_key, "admin key")
            if op in (Op.ENGINES, Op.RL) and self._admin_key is not None
            else (self._api_key, "API key")
        )
        if key is None:
            return
        supplied = next((v for k, v in headers if k == "authorization"), "")
        scheme, _, token = supplied.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), key):
            raise Unauthorized(f"missing or invalid {what} (send 'Authorization: Bearer <key>')")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        method: str = scope["method"]
        # The raw path keeps "%2F" inside a session id from splitting the path.
        raw_path: bytes | None = scope.get("raw_path")
        path: str = raw_path.decode("latin-1") if raw_path else scope["path"]
        if path in DOCS_PATHS and method in ("GET", "HEAD"):
            # Open like /health: a browser fetches the schema without the key, and the
            # schema holds nothing the docs do not publish.
            await self._serve_docs(scope, receive, send)
            return
        headers = [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope["headers"]]

        async def read_body() -> bytes:
            declared = next((v for k, v in headers if k == "content-length"), None)
            return await _read_body(
                receive,
                self.settings.max_body_bytes,
                int(declared) if declared and declared.isdigit() else None,
                self.settings.body_timeout,
            )

        async def gone() -> None:
            # After the body: the next message is the client's disconnect.
            while (await receive())["type"] != "http.disconnect":
                pass

        query = scope.get("query_string", b"").decode("latin-1")
        reply = await self.respond(method, path, query, headers, read_body, gone)
        if reply is not None:
            await send_reply(send, reply, head_only=method == "HEAD")

    async def respond(
        self,
        method: str,
        path: str,
        query: str,
        headers: list[tuple[str, str]],
        read_body: Callable[[], Awaitable[bytes]],
        gone: Callable[[], Awaitable[None]] | None = None,
    ) -> CoreReply | None:
        """The reply to one request (`headers` with lowercased names), errors included;
        None when the client left while sending its body. Shared by the ASGI server and the
        compiled front's dispatched requests (front/dispatched.py). `gone`: returns when the
        client disconnects (after its body), which cancels an RL control call."""
        reply = await self._respond(method, path, query, headers, read_body, gone)
        if reply is not None and reply.status >= 400 and reply.stream is None:
            # A dialect route's refusals, wherever they were made (here, the router, the
            # worker), reach its client in the dialect's error envelope.
            name = dialect_of_path(path)
            if name is not None:
                wrapped = gateway_error_in_dialect(name, reply.status, reply.body)
                if wrapped is not None:
                    reply.body = wrapped
        return reply

    async def _respond(
        self,
        method: str,
        path: str,
        query: str,
        headers: list[tuple[str, str]],
        read_body: Callable[[], Awaitable[bytes]],
        gone: Callable[[], Awaitable[None]] | None = None,
    ) -> CoreReply | None:
        try:
            route = classify(method, path, headers, self.settings.session_headers)
            if route.op is Op.DOCS:
                # Only the HTTP server can serve these (FastAPI, above).
                raise RouteNotFound(f"{path} is served by the HTTP server only")
            if route.op is not Op.HEALTH:
                self._check_auth(headers, route.op)
            body = await read_body()
            if self._api_key is not None or self._admin_key is not None:
                # The gateway's key is not the upstream's.
                headers = [(k, v) for k, v in headers if k != "authorization"]
            request = CoreRequest(
                op=route.op,
                session_id=route.session_id,
                path=route.upstream_path or path,
                method=method,
                query=query,
                headers=headers,
                body=body,
                auto_create=route.auto_create,
            )
            if route.op is Op.RL and gone is not None:
                return await _unless_gone(self.handler(request), gone)
            return await self.handler(request)
        except BodyTimeout as error:
            # The rest of the body may still come: the connection cannot carry another
            # request, so the reply closes it.
            reply = error_reply(error)
            reply.headers.append(("connection", "close"))
            return reply
        except GatewayError as error:
            return error_reply(error)
        except ConnectionResetError:
            return None
        except Exception as exc:  # a bug must cost one request, never the process
            logger.exception("unexpected error handling %s %s", method, path)
            return error_reply(GatewayError(f"internal error: {type(exc).__name__}: {exc}"))

    async def _serve_docs(self, scope: Scope, receive: Receive, send: Send) -> None:
        """/openapi.json and /docs, delegated whole to FastAPI (front/openapi.py)."""
        app = self._docs_app
        if app is None:
            # In a thread: importing FastAPI and generating the schema take a few hundred ms
            # that must not stall this loop's other requests (the router's /health).
            app = self._docs_app = await asyncio.to_thread(_build_docs_app)
        await app(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _unless_gone(
    answer: Awaitable[CoreReply], gone: Callable[[], Awaitable[None]]
) -> CoreReply | None:
    """`answer`, cancelled when the client leaves first (None then): a trainer that gives
    up on a control call does not leave it running against its engines."""
    work = asyncio.ensure_future(answer)
    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        work.cancel()
        raise
    finally:
        watch.cancel()
    if work.done():
        return work.result()
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await work
    logger.info("client left: its RL control call was cancelled")
    return None


def _build_docs_app() -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    # Imported here, never at module level: the router must not load FastAPI unless asked
    # for its documentation (tests/dataplane/test_dataplane.py).
    from sessiongate.front.openapi import build_app

    app = build_app()
    app.openapi()  # generated now, in the worker thread, not on the first request's loop
    return app

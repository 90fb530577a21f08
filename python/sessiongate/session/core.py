"""The session core: HTTP-agnostic handling of every session operation.

Each operation takes a `CoreRequest` (the same fields the IPC request meta carries) and
returns a `CoreReply` (status, headers, body bytes or a stream of chunks), so the in-process
app and the multi-process workers run exactly this code. This module dispatches operations
and proxies stateless ones; the registry and its limits (registry.py), the reads (reads.py)
and the three-phase turn (turn.py) are the parts `SessionCore` is made of.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from sessiongate.errors import BadRequest, GatewayError, LimitReached, UpstreamError
from sessiongate.protocol import (
    CoreReply,
    CoreRequest,
    Op,
    error_reply,
    json_reply,
    parse_json_object,
)
from sessiongate.session.reads import SessionReads
from sessiongate.session.turn import SessionTurns

# Proxied replies with a declared length below this are read whole and relayed in one frame.
PROXY_BUFFER_BELOW = 256 * 1024


class SessionCore(SessionTurns, SessionReads):
    """Sessions of one worker: a registry, the TITO engine, and one upstream client."""

    def operations(self) -> dict[str, Callable[[CoreRequest], Awaitable[CoreReply]]]:
        return {
            Op.HEALTH: self._health,
            Op.CREATE: self._create,
            Op.GET: self._get,
            Op.DELETE: self._delete,
            Op.CHAT: self._chat,
            Op.PROXY: self._proxy,
            Op.TRAJECTORY: self._trajectory,
            Op.SAMPLES: self._samples,
            Op.SET_ENGINES: self._set_engines,
        }

    async def handle(self, request: CoreRequest) -> CoreReply:
        self.start()
        if request.op is not Op.HEALTH:  # health checks come on a timer, not with work
            self._trimmer.active()
        handler = self._ops.get(request.op)
        if handler is None:
            return error_reply(BadRequest(f"unknown operation {request.op!r}"))
        try:
            return await handler(request)
        except LimitReached as error:
            reply = error_reply(error)
            reply.headers.append(("retry-after", str(error.retry_after)))
            return reply
        except GatewayError as error:
            return error_reply(error)

    async def aclose(self) -> None:
        """Shutdown: end every session (hooks fire once each), then close the upstreams."""
        if self._expiry is not None:
            self._expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry
        for session in list(self.sessions.values()):
            await self._close(session, "shutdown")
        # A trim still waiting for a quiet spell is moot once the process is ending.
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.stamper is not None:
            self.stamper.release_all()
        await self.upstream.aclose()
        if self.store is not None:
            await asyncio.to_thread(self.store.close)

    async def _set_engines(self, request: CoreRequest) -> CoreReply:
        """The router's engine set (its registry's ready engines) for this core's pool. Sent
        on every change and again whenever this worker (re)connects, so a restarted worker
        process, which starts from its --backend argv, converges on the live set."""
        document = parse_json_object(request.body, "the engine set")
        urls = document.get("urls")
        if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
            raise BadRequest('the engine set must be {"urls": [string, ...]}')
        try:
            self.upstream.set_urls(urls)
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        return json_reply(200, {"urls": self.upstream.urls})

    async def _proxy(self, request: CoreRequest) -> CoreReply:
        root_id = None
        headers = request.headers
        if request.session_id is not None:
            session_id = self._session_id(request)
            root_id = self._open_session(session_id).root_id
            if self.settings.smg_routing_key:
                # The rollout framework stamps its session proxy requests too.
                headers = [
                    *(h for h in headers if h[0].lower() != "x-smg-routing-key"),
                    ("X-SMG-Routing-Key", session_id),
                ]
        stream = await self.upstream.open_stream(
            root_id,
            request.method,
            request.path,
            query=request.query,
            headers=headers,
            body=request.body,
        )
        if stream.small_body_length(PROXY_BUFFER_BELOW) is not None:
            # A small, declared-length body is cheaper to relay whole than as a stream.
            return CoreReply(stream.status, stream.headers, await stream.read_all())
        return CoreReply(stream.status, stream.headers, stream=stream.chunks())


__all__ = ["CoreReply", "CoreRequest", "SessionCore", "UpstreamError", "error_reply", "json_reply"]

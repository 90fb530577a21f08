"""Answer the requests the compiled front dispatches to Python (`_core.DispatchedRequest`).

The front keeps the connection and did the HTTP work (head, body, limits, timeouts); this
module runs the request through the same `GatewayApp.respond` the ASGI server calls and
passes the reply back: whole, or part by part with the front's flow control (a send that
fills its queue waits for the front to say the client took enough of it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from sessiongate.errors import GatewayError
from sessiongate.front.asgi import GatewayApp
from sessiongate.protocol import CoreReply, FilePart, LendOffer, close_stream, error_reply

logger = logging.getLogger(__name__)

# `DispatchedRequest.send` answers (rust/front/dispatch.rs).
SENT, FULL, GONE = 0, 1, -1


class DispatchedRequests:
    """Serves dispatched requests with `app`; `wake` is called for writable ids."""

    def __init__(self, app: GatewayApp) -> None:
        self.app = app
        self._tasks: set[asyncio.Task[None]] = set()
        self._waiting: dict[int, asyncio.Future[None]] = {}

    def serve(self, requests: list[Any]) -> None:
        loop = asyncio.get_running_loop()
        for request in requests:
            task = loop.create_task(self._answer(request))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def writable(self, ids: list[int]) -> None:
        for request_id in ids:
            waiter = self._waiting.pop(request_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    async def drain(self, grace: float) -> None:
        """Let the requests in progress finish for up to `grace` seconds, then cancel them."""
        if not self._tasks:
            return
        _, pending = await asyncio.wait(set(self._tasks), timeout=grace)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)

    async def _answer(self, request: Any) -> None:
        path, _, query = request.target.partition("?")
        body: bytes = request.body

        async def read_body() -> bytes:
            return body

        reply = await self.app.respond(request.method, path, query, request.headers, read_body)
        if reply is None:
            return
        try:
            if reply.stream is None:
                request.reply(reply.status, reply.headers, _as_bytes(reply.body))
                return
            started = request.start(reply.status, reply.headers)
        except ValueError as exc:
            # A head the front refuses (a header value with a newline, a bad status): the bug
            # costs this request a 500, as under the ASGI server.
            logger.exception("cannot send the reply to %s %s", request.method, request.target)
            await close_stream(reply.stream)
            error = error_reply(GatewayError(f"internal error: invalid reply: {exc}"))
            request.reply(error.status, error.headers, error.body)
            return
        await self._stream(request, reply, reply.stream, gone=not started)

    async def _stream(
        self,
        request: Any,
        reply: CoreReply,
        stream: AsyncIterator[bytes | FilePart | LendOffer],
        *,
        gone: bool,
    ) -> None:
        complete = False
        lent = False
        try:
            async for chunk in stream:
                if gone:
                    if isinstance(chunk, FilePart):
                        chunk.close()
                    if reply.coalesce:
                        break  # a bulk dump nobody reads: stop making it
                    # A live stream (a session turn's SSE) runs to its end, as under the ASGI
                    # server: the turn is still recorded when its client left early.
                    continue
                if isinstance(chunk, LendOffer):
                    # The worker writes the body on the connection; its end comes after.
                    lent = True
                    state = SENT if request.lend(chunk.path) else GONE
                elif isinstance(chunk, FilePart):
                    # A shared-memory segment (a records GET): the front sends the file.
                    state = request.send_file(chunk.take_fd(), chunk.length)
                else:
                    state = request.send(_as_bytes(chunk))
                if state == FULL:
                    gone = await self._until_writable(request)
                elif state == GONE:
                    gone = True
            complete = not gone
        except Exception as exc:
            # The head is out: cutting the reply is all that can tell the client.
            if lent:  # most often the client left while the worker wrote: no traceback
                logger.info("lent reply for %s %s cut: %s", request.method, request.target, exc)
            else:
                logger.exception("reply stream failed for %s %s", request.method, request.target)
        finally:
            await close_stream(stream)
            if complete:
                request.end()
            else:
                request.abort()

    async def _until_writable(self, request: Any) -> bool:
        """Wait until the front took enough of the queue; True when the client is gone."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiting[request.id] = waiter
        try:
            await waiter
        finally:
            self._waiting.pop(request.id, None)
        return not request.connected


def _as_bytes(data: bytes | bytearray | memoryview) -> bytes:
    return data if type(data) is bytes else bytes(data)

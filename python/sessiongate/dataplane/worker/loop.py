"""The worker's side of its channel: decode requests, run them on the session core, reply.

A bad request never kills the worker: an unexpected exception becomes an ERROR frame for that
request only. Large reply bodies go out as BODY frames of at most CHUNK_SIZE, paced by the
router's credit, so small replies on the same channel never wait behind them. A bulk reply
(a records GET) of a worker the router started is written by the worker on the client's
connection when the front lends it (transport/lent_replies.py), else as shared-memory files,
one BODY_FILE frame per segment, with the same credit (transport/reply_files.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, cast

from sessiongate.dataplane.transport.connection import FrameConnection
from sessiongate.dataplane.transport.frames import (
    CHUNK_SIZE,
    CREDIT_WINDOW,
    FRAME_BODY,
    FRAME_BODY_FILE,
    FRAME_BODY_LEND,
    FRAME_CANCEL,
    FRAME_CREDIT,
    FRAME_END,
    FRAME_ERROR,
    FRAME_HEARTBEAT,
    FRAME_REPLY,
    FRAME_REPLY_HEAD,
    FRAME_REQUEST,
    HEARTBEAT_INTERVAL,
    decode_credit,
)
from sessiongate.dataplane.transport.lent_replies import (
    ClientGone,
    Listener,
    offer_frame,
    write_chunks,
)
from sessiongate.dataplane.transport.reply_files import (
    SEGMENT,
    discard_segment,
    segment_frame,
    write_segment,
)
from sessiongate.primitives import FrameError, FrameTooLarge, decode_envelope, encode_envelope
from sessiongate.protocol import CoreReply, CoreRequest, close_stream

logger = logging.getLogger(__name__)

# Parts shorter than this are joined into a segment (one small copy); longer ones go as
# views of themselves (writev takes them as they are).
SMALL_PART = 64 << 10

Handler = Callable[[CoreRequest], Awaitable[CoreReply]]


class _Credit:
    """How many BODY frames a stream may still send before the router asks for more."""

    def __init__(self, window: int) -> None:
        self.available = window
        self._changed = asyncio.Event()

    def add(self, count: int) -> None:
        self.available += count
        self._changed.set()

    async def take(self) -> None:
        while self.available <= 0:
            self._changed.clear()
            await self._changed.wait()
        self.available -= 1


async def _coalesce(parts: AsyncIterator[bytes], limit: int) -> AsyncIterator[bytes | memoryview]:
    """Join small parts into chunks up to `limit`, splitting large ones. A large part goes
    out as views of itself (the frame writer copies it once, into the socket); only what is
    joined is copied here."""
    buffer = bytearray()
    async for part in parts:
        view = memoryview(part)
        if buffer:
            room = limit - len(buffer)
            buffer += view[:room]
            view = view[room:]
            if len(buffer) < limit:
                continue
            yield bytes(buffer)
            buffer.clear()
        while len(view) >= limit:
            yield view[:limit]
            view = view[limit:]
        if view:
            buffer += view
    if buffer:
        yield bytes(buffer)


async def _gather(
    parts: AsyncIterator[bytes], limit: int, small: int = SMALL_PART
) -> AsyncIterator[list[memoryview]]:
    """Group parts into segments of `limit` bytes (the last may be shorter), each a list of
    views: a large part is cut into views of itself, never copied here; only runs of parts
    under `small` bytes are joined. (Joining 4 MiB segments into one buffer cost the event
    loop a 4-12 MiB copy per 22 MiB record, with fresh pages each, while small requests
    waited.)"""
    segment: list[memoryview] = []
    size = 0
    joined = bytearray()
    async for part in parts:
        view = memoryview(part)
        while view:
            piece = view[: limit - size]
            view = view[len(piece) :]
            if len(piece) < small:
                joined += piece
            else:
                if joined:
                    segment.append(memoryview(bytes(joined)))
                    joined.clear()
                segment.append(piece)
            size += len(piece)
            if size == limit:
                if joined:
                    segment.append(memoryview(bytes(joined)))
                    joined.clear()
                yield segment
                segment, size = [], 0
    if joined:
        segment.append(memoryview(bytes(joined)))
    if segment:
        yield segment


class RouterGone(Exception):
    """The channel to the router failed while sending."""


class WorkerLoop:
    def __init__(
        self,
        conn: FrameConnection,
        handler: Handler,
        *,
        index: int,
        generation: int,
        status: Callable[[], dict[str, Any]] | None = None,
        reply_dir: str | None = None,
        lend_replies: bool = False,
    ) -> None:
        self.conn = conn
        # Offer bulk replies to be written on the client's connection (lent_replies.py);
        # only with a reply directory, where the offer's socket lives.
        self.lend_replies = lend_replies
        # Bulk replies written on a lent connection (in the heartbeat, so in /health).
        self.replies_lent = 0
        # Where bulk replies go as files for the router (transport/reply_files.py); None
        # for a worker that is not the router's child (TCP), or without shared memory.
        self.reply_dir = reply_dir
        self.handler = handler
        self.index = index
        self.generation = generation
        self.status = status or dict
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.credits: dict[int, _Credit] = {}

    async def run(self) -> str:
        """Serve until the router closes the channel; returns why it ended."""
        heartbeat = asyncio.create_task(self._heartbeat())
        try:
            async for frame_type, request_id, payload in self.conn.frames():
                if frame_type == FRAME_REQUEST:
                    task = asyncio.create_task(self._handle(request_id, payload))
                    self.tasks[request_id] = task
                elif frame_type == FRAME_CANCEL:
                    running = self.tasks.get(request_id)
                    if running is not None:
                        running.cancel()
                elif frame_type == FRAME_CREDIT:
                    credit = self.credits.get(request_id)
                    if credit is not None:
                        credit.add(decode_credit(payload))
            return "router closed the channel"
        except FrameError as exc:
            return f"corrupt frame from router: {exc}"
        except (OSError, ConnectionError) as exc:
            return f"read error: {exc}"
        finally:
            heartbeat.cancel()
            for task in list(self.tasks.values()):
                task.cancel()

    async def _heartbeat(self) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while True:
                document = {
                    "pid": os.getpid(),
                    "index": self.index,
                    "generation": self.generation,
                    "inflight": len(self.tasks),
                    "replies_lent": self.replies_lent,
                    **self.status(),
                }
                await self.conn.send(FRAME_HEARTBEAT, 0, json.dumps(document).encode())
                await asyncio.sleep(HEARTBEAT_INTERVAL)

    async def _handle(self, request_id: int, payload: bytes) -> None:
        reply: CoreReply | None = None
        try:
            meta, body = decode_envelope(payload)
            reply = await self.handler(CoreRequest.from_meta(meta, bytes(body)))
            await self._send_reply(request_id, reply)
        except asyncio.CancelledError:
            pass
        except RouterGone:
            pass  # run() ends on EOF
        except Exception as exc:  # a bad request must cost one request, never the worker
            logger.exception("worker %d: request %d failed", self.index, request_id)
            message = f"internal error in worker {self.index}: {type(exc).__name__}: {exc}"
            with contextlib.suppress(ConnectionError, OSError):
                await self.conn.send(FRAME_ERROR, request_id, message.encode())
        finally:
            self.tasks.pop(request_id, None)
            self.credits.pop(request_id, None)
            if reply is not None:
                with contextlib.suppress(Exception):
                    await close_stream(reply.stream)

    async def _send(
        self, frame_type: int, request_id: int, payload: bytes | memoryview = b""
    ) -> None:
        """Send one frame; a failing channel is RouterGone, told apart from the reply's own
        errors (a records file that cannot be read must fail the request, not hang it)."""
        try:
            await self.conn.send(frame_type, request_id, payload)
        except FrameTooLarge:
            raise
        except (ConnectionError, OSError) as exc:
            raise RouterGone(str(exc)) from exc

    async def _send_segments(
        self, request_id: int, stream: AsyncIterator[bytes], credit: _Credit, directory: str
    ) -> None:
        """A bulk body as shared-memory files of SEGMENT bytes (BODY_FILE frames); once the
        directory cannot take one (full, gone), the rest as BODY frames."""
        files = True
        async for segment in _gather(stream, SEGMENT):
            name = await write_segment(directory, segment, str(request_id)) if files else None
            if name is not None:
                frame = segment_frame(name, sum(len(view) for view in segment))
                await credit.take()
                try:
                    await self._send(FRAME_BODY_FILE, request_id, frame)
                except BaseException:
                    discard_segment(directory, frame)
                    raise
                continue
            if files:
                logger.warning(
                    "worker %d: no room for segments in %s: frames for reply %d",
                    self.index,
                    directory,
                    request_id,
                )
                files = False
            for view in segment:
                for start in range(0, len(view), CHUNK_SIZE):
                    await credit.take()
                    await self._send(FRAME_BODY, request_id, view[start : start + CHUNK_SIZE])
        await self._send(FRAME_END, request_id)

    async def _send_lent(
        self, request_id: int, stream: AsyncIterator[bytes], directory: str
    ) -> bool:
        """Offer to write a bulk body on the client's connection (transport/lent_replies.py);
        False when the front refused or did not answer (nothing of the body was sent)."""
        try:
            listener = Listener(directory, str(request_id))
        except OSError:
            return False  # no socket can be made there: files or frames then
        try:
            await self._send(FRAME_BODY_LEND, request_id, offer_frame(listener.name))
            fd = await listener.answer()
        finally:
            listener.close()
        if fd is None:
            return False
        try:
            await write_chunks(fd, _gather(stream, SEGMENT))
        except ClientGone as exc:
            # The front cuts the reply; nothing for the log (a client may leave).
            await self._send(FRAME_ERROR, request_id, str(exc).encode())
            return True
        self.replies_lent += 1
        await self._send(FRAME_END, request_id)
        return True

    async def _send_reply(self, request_id: int, reply: CoreReply) -> None:
        meta = {"status": reply.status, "headers": [list(h) for h in reply.headers]}
        if reply.stream is None and len(reply.body) <= CHUNK_SIZE:
            try:
                await self._send(FRAME_REPLY, request_id, encode_envelope(meta, reply.body))
            except FrameTooLarge as exc:
                await self._send(FRAME_ERROR, request_id, f"reply too large: {exc}".encode())
            return
        credit = _Credit(CREDIT_WINDOW)
        self.credits[request_id] = credit
        await self._send(FRAME_REPLY_HEAD, request_id, encode_envelope(meta, b""))
        parts: AsyncIterator[bytes | memoryview]
        # Replies made here hold bytes only (FileParts exist on the router's side).
        stream = cast("AsyncIterator[bytes] | None", reply.stream)
        if stream is None:
            parts = _single(reply.body)
        elif reply.coalesce and self.reply_dir is not None:
            if self.lend_replies and await self._send_lent(request_id, stream, self.reply_dir):
                return
            await self._send_segments(request_id, stream, credit, self.reply_dir)
            return
        elif reply.coalesce:
            parts = _coalesce(stream, CHUNK_SIZE)
        else:
            parts = _split(stream, CHUNK_SIZE)
        async for chunk in parts:
            await credit.take()
            await self._send(FRAME_BODY, request_id, chunk)
        await self._send(FRAME_END, request_id)


async def _single(body: bytes) -> AsyncIterator[bytes | memoryview]:
    view = memoryview(body)
    for start in range(0, len(view), CHUNK_SIZE):
        yield view[start : start + CHUNK_SIZE]


async def _split(parts: AsyncIterator[bytes], limit: int) -> AsyncIterator[bytes | memoryview]:
    """Pass parts through as they come (latency matters, e.g. SSE), splitting large ones
    into views of themselves."""
    async for part in parts:
        if len(part) <= limit:
            yield part
            continue
        view = memoryview(part)
        for start in range(0, len(view), limit):
            yield view[start : start + limit]

"""The router's side of one worker's channel: requests multiplexed by id, replies matched out
of order, streamed bodies with credit-based flow control, cancel-safe.

Every failure of the channel (EOF, read error, corrupt frame) fails every pending request
with `WorkerLost` naming the worker, and leaves the channel closed for good; the supervisor
starts a new worker and hands the router a new channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from sessiongate.dataplane.transport.connection import FrameConnection
from sessiongate.dataplane.transport.frames import (
    CREDIT_WINDOW,
    FRAME_BODY,
    FRAME_BODY_FILE,
    FRAME_BODY_LEND,
    FRAME_CANCEL,
    FRAME_CREDIT,
    FRAME_END,
    FRAME_ERROR,
    FRAME_HEARTBEAT,
    FRAME_NAMES,
    FRAME_REPLY,
    FRAME_REPLY_HEAD,
    FRAME_REQUEST,
    encode_credit,
)
from sessiongate.dataplane.transport.lent_replies import open_offer
from sessiongate.dataplane.transport.reply_files import discard_segment, open_segment
from sessiongate.primitives import FrameError, decode_envelope, encode_envelope
from sessiongate.protocol import CoreReply, FilePart, LendOffer

logger = logging.getLogger(__name__)


class WorkerLost(Exception):
    """The worker's channel closed; requests on it cannot complete (HTTP 503)."""


class WorkerFailed(Exception):
    """The worker answered this request with an ERROR frame (HTTP 502)."""


_END = object()


@dataclass
class _Pending:
    head: asyncio.Future[tuple[int, bytes]]
    chunks: asyncio.Queue[object] = field(default_factory=asyncio.Queue)


class WorkerChannel:
    def __init__(
        self,
        index: int,
        conn: FrameConnection,
        *,
        generation: int = 0,
        endpoint: str | None = None,
        reply_dir: str | None = None,
    ) -> None:
        self.index = index
        # The directory of this router's file replies (transport/reply_files.py): only a
        # worker it started may answer with a file; None refuses them.
        self.reply_dir = reply_dir
        self.generation = generation
        # HOST:PORT of a remote (TCP) worker, named in every error about it.
        self.endpoint = endpoint
        self.conn = conn
        self.pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self.down_reason: str | None = None
        self.last_heartbeat: float | None = None
        self.heartbeat: dict[str, Any] = {}
        self.bytes_relayed = 0
        self._reader: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()

    @property
    def name(self) -> str:
        pid = self.heartbeat.get("pid")
        details = [d for d in (self.endpoint, f"pid {pid}" if pid else None) if d]
        return f"worker {self.index}" + (f" ({', '.join(details)})" if details else "")

    @property
    def up(self) -> bool:
        return self.down_reason is None and self.last_heartbeat is not None

    def start(self) -> None:
        self._reader = asyncio.create_task(self._read_loop(), name=f"channel-{self.index}")

    async def _read_loop(self) -> None:
        reason = "connection closed (worker exited)"
        try:
            async for frame_type, request_id, payload in self.conn.frames():
                self._on_frame(frame_type, request_id, payload)
        except FrameError as exc:
            reason = f"corrupt frame from worker: {exc}"
        except (OSError, ConnectionError) as exc:
            reason = f"read error: {exc}"
        except asyncio.CancelledError:
            reason = "router shutting down"
            raise
        finally:
            self._fail_all(reason)

    def _on_frame(self, frame_type: int, request_id: int, payload: bytes) -> None:
        if frame_type == FRAME_HEARTBEAT:
            self.last_heartbeat = time.monotonic()
            with contextlib.suppress(ValueError):
                self.heartbeat = json.loads(payload)
            return
        pending = self.pending.get(request_id)
        if pending is None:
            # A late frame for a cancelled request: dropped, never misdelivered (a file
            # segment removed with it).
            if frame_type == FRAME_BODY_FILE:
                discard_segment(self.reply_dir, payload)
            return
        if frame_type in (FRAME_REPLY, FRAME_REPLY_HEAD, FRAME_ERROR) and not pending.head.done():
            if frame_type == FRAME_ERROR:
                self.pending.pop(request_id, None)
                message = payload.decode("utf-8", "replace")
                pending.head.set_exception(WorkerFailed(f"{self.name}: {message}"))
            else:
                if frame_type == FRAME_REPLY:
                    self.pending.pop(request_id, None)
                pending.head.set_result((frame_type, payload))
        elif frame_type == FRAME_BODY:
            self.bytes_relayed += len(payload)
            pending.chunks.put_nowait(payload)
        elif frame_type in (FRAME_BODY_FILE, FRAME_BODY_LEND):
            try:
                part: FilePart | LendOffer = (
                    open_segment(self.reply_dir, payload)
                    if frame_type == FRAME_BODY_FILE
                    else open_offer(self.reply_dir, payload)
                )
            except ValueError as exc:
                self._abandon(request_id)
                pending.chunks.put_nowait(WorkerFailed(f"{self.name}: {exc}"))
                return
            if isinstance(part, FilePart):
                self.bytes_relayed += part.length
            pending.chunks.put_nowait(part)
        elif frame_type == FRAME_END:
            self.pending.pop(request_id, None)
            pending.chunks.put_nowait(_END)
        elif frame_type == FRAME_ERROR:
            self.pending.pop(request_id, None)
            message = payload.decode("utf-8", "replace")
            pending.chunks.put_nowait(WorkerFailed(f"{self.name}: {message}"))
        else:
            logger.warning(
                "%s sent unexpected %s frame for request %d",
                self.name,
                FRAME_NAMES.get(frame_type, frame_type),
                request_id,
            )

    def close(self, reason: str) -> None:
        """Tear the channel down from the router's side (e.g. the worker stopped beating)."""
        self._fail_all(reason)

    async def wait_closed(self) -> None:
        """Return once the channel is down for good."""
        if self._reader is not None:
            await asyncio.wait({self._reader})

    def _fail_all(self, reason: str) -> None:
        if self.down_reason is None:
            self.down_reason = reason
            logger.warning("%s is down: %s", self.name, reason)
        error = WorkerLost(f"{self.name} is down: {reason}")
        for pending in self.pending.values():
            if not pending.head.done():
                pending.head.set_exception(error)
            else:
                pending.chunks.put_nowait(error)
        self.pending.clear()
        self.conn.close()

    def _send_soon(self, frame_type: int, request_id: int, payload: bytes = b"") -> None:
        """Fire-and-forget control frame (CANCEL, CREDIT)."""
        if self.down_reason is not None:
            return

        async def send() -> None:
            with contextlib.suppress(ConnectionError, OSError):
                await self.conn.send(frame_type, request_id, payload)

        task = asyncio.create_task(send())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _abandon(self, request_id: int) -> None:
        if self.pending.pop(request_id, None) is not None:
            self._send_soon(FRAME_CANCEL, request_id)

    async def request(self, meta: dict[str, Any], body: bytes) -> CoreReply:
        """Send one request; the reply, with `stream` set when the body is streamed.

        Raises WorkerLost (channel down), WorkerFailed (ERROR frame) or FrameTooLarge.
        """
        if self.down_reason is not None:
            raise WorkerLost(f"{self.name} is down: {self.down_reason}")
        payload = encode_envelope(meta, body)
        request_id = next(self._ids)
        pending = _Pending(asyncio.get_running_loop().create_future())
        self.pending[request_id] = pending
        try:
            await self.conn.send(FRAME_REQUEST, request_id, payload)
            frame_type, head = await pending.head
        except (ConnectionError, OSError) as exc:
            self.pending.pop(request_id, None)
            raise WorkerLost(f"{self.name} is down: send failed ({exc})") from exc
        except asyncio.CancelledError:
            self._abandon(request_id)
            raise
        except BaseException:
            self.pending.pop(request_id, None)
            raise
        reply_meta, reply_body = decode_envelope(head)
        status = int(reply_meta["status"])
        headers = [(str(k), str(v)) for k, v in reply_meta.get("headers", [])]
        if frame_type == FRAME_REPLY:
            self.bytes_relayed += len(reply_body)
            return CoreReply(status, headers, bytes(reply_body))
        return CoreReply(status, headers, stream=self._stream(request_id, pending))

    async def _stream(
        self, request_id: int, pending: _Pending
    ) -> AsyncIterator[bytes | FilePart | LendOffer]:
        consumed = 0
        finished = False
        try:
            while True:
                item = await pending.chunks.get()
                if item is _END:
                    finished = True
                    return
                if isinstance(item, Exception):
                    finished = True
                    raise item
                assert isinstance(item, (bytes, FilePart, LendOffer))
                yield item
                if isinstance(item, LendOffer):
                    continue  # the offer cost the worker no credit
                consumed += 1
                # Return credit in batches: half a window keeps the worker busy without
                # a control frame per chunk.
                if consumed == CREDIT_WINDOW // 2:
                    self._send_soon(FRAME_CREDIT, request_id, encode_credit(consumed))
                    consumed = 0
        finally:
            if not finished:
                self._abandon(request_id)
            while not pending.chunks.empty():  # segments nobody will read: their files close
                item = pending.chunks.get_nowait()
                if isinstance(item, FilePart):
                    item.close()

    async def aclose(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        self.conn.close()

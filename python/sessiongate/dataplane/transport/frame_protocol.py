"""Frames read straight from the socket into one reused buffer: the UNIX-socket channel's
reader and writer, without asyncio's streams.

`StreamReader` costs a large reply three user-space copies before the frame decoder sees it
(the transport's fresh `bytes` per read, the stream's buffer, the slice `read` returns);
here the event loop's `recv_into` fills a buffer that lives as long as the connection and
the decoder copies each payload once, into the `bytes` it hands out. A records GET relayed
by the router costs that much less per MiB (docs/performance.md, "Records at copy speed").

Flow control matches the streams': reading pauses while more than `PAUSE_AT` payload bytes
are decoded but not yet taken by the consumer, and a writer waits while the transport's
buffer is over its high-water mark.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator

from sessiongate.primitives import FrameDecoder, FrameError

READ_SIZE = 256 * 1024
# Decoded payload bytes waiting for the consumer at which reading pauses (StreamReader's
# limit was 4 x READ_SIZE of raw bytes), and at which it resumes.
PAUSE_AT = 4 * READ_SIZE
RESUME_AT = READ_SIZE


class _End:
    """The stream ended cleanly (EOF between frames)."""


END = _End()


class FrameProtocol(asyncio.BufferedProtocol):
    def __init__(self, max_frame: int) -> None:
        self.decoder = FrameDecoder(max_frame)
        self.view = memoryview(bytearray(READ_SIZE))
        self.frames: collections.deque[tuple[int, int, bytes]] = collections.deque()
        self.queued = 0
        self.ready = asyncio.Event()
        # Why the stream ended (END, or the error the reader raises), None while it runs.
        self.end: _End | BaseException | None = None
        self.transport: asyncio.Transport | None = None
        self.reading_paused = False
        self.writable = asyncio.Event()
        self.writable.set()
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.view

    def buffer_updated(self, nbytes: int) -> None:
        if self.end is not None:
            return
        try:
            frames = self.decoder.feed(self.view[:nbytes])
        except FrameError as exc:
            self._finish(exc)
            if self.transport is not None:
                self.transport.close()
            return
        for frame in frames:
            self.frames.append(frame)
            self.queued += len(frame[2])
        if frames:
            self.ready.set()
        if self.queued > PAUSE_AT and not self.reading_paused and self.transport is not None:
            self.transport.pause_reading()
            self.reading_paused = True

    def eof_received(self) -> bool:
        if self.decoder.buffered:
            self._finish(
                ConnectionError(
                    f"IPC connection closed inside a frame ({self.decoder.buffered} bytes pending)"
                )
            )
        else:
            self._finish(END)
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish(END if exc is None else exc)
        self.lost = True
        self.writable.set()  # a waiting writer finds out

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def _finish(self, why: _End | BaseException) -> None:
        if self.end is None:
            self.end = why
        self.ready.set()

    async def frames_until_end(self) -> AsyncIterator[tuple[int, int, bytes]]:
        while True:
            while self.frames:
                frame = self.frames.popleft()
                self.queued -= len(frame[2])
                if self.reading_paused and self.queued <= RESUME_AT and self.transport:
                    self.reading_paused = False
                    self.transport.resume_reading()
                yield frame
            if self.end is not None:
                if isinstance(self.end, BaseException):
                    raise self.end
                return
            # No callback runs between the check above and the clear: nothing is missed.
            self.ready.clear()
            await self.ready.wait()

    async def drain(self) -> None:
        """Wait until the transport takes more; ConnectionResetError once it is gone."""
        if not self.writable.is_set():
            await self.writable.wait()
        if self.lost:
            raise ConnectionResetError("IPC connection lost")

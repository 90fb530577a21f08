"""One end of a framed IPC stream: a reader that yields frames, a writer that never interleaves
the bytes of two frames and never copies a large payload into the event loop in one go.

A UNIX-socket channel (`open`) reads through `FrameProtocol` (frame_protocol.py: one reused
buffer, no stream copies); a channel built over streams someone else opened (`from_streams`:
a TCP channel after its handshake) reads through them."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

from sessiongate.dataplane.transport.frame_protocol import READ_SIZE, FrameProtocol
from sessiongate.dataplane.transport.frames import CHUNK_SIZE
from sessiongate.primitives import DEFAULT_MAX_FRAME, FrameDecoder, encode_frame_header

__all__ = ["READ_SIZE", "FrameConnection"]


class FrameConnection:
    def __init__(self, sock: socket.socket | None, *, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.sock = sock
        self.max_frame = max_frame
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._protocol: FrameProtocol | None = None
        # FIFO: frames from concurrent senders go out whole and in arrival order, so a
        # stream of bounded chunks interleaves fairly with small replies.
        self._write_lock = asyncio.Lock()
        self.closed = False

    @classmethod
    def from_streams(
        cls,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        max_frame: int = DEFAULT_MAX_FRAME,
    ) -> FrameConnection:
        """Frames over an already open stream (a TCP channel after its handshake); bytes the
        reader already buffered are the first frames'."""
        conn = cls(None, max_frame=max_frame)
        conn._reader, conn._writer = reader, writer
        return conn

    async def open(self) -> FrameConnection:
        """Open the streams of the UNIX socket given at construction."""
        if self.sock is None:
            raise ConnectionError("FrameConnection has no socket to open")
        self.sock.setblocking(False)
        loop = asyncio.get_running_loop()
        _, self._protocol = await loop.create_unix_connection(
            lambda: FrameProtocol(self.max_frame), sock=self.sock
        )
        return self

    async def send(
        self, frame_type: int, request_id: int, payload: bytes | memoryview = b""
    ) -> None:
        """Send one frame; FrameTooLarge (for this frame only) when over the cap."""
        header = encode_frame_header(frame_type, request_id, len(payload), max_frame=self.max_frame)
        write, drain = self._write_and_drain()
        async with self._write_lock:
            write(header)
            view = memoryview(payload)
            # Hand large payloads to the transport in slices: one huge write() copies the
            # whole payload inside the event loop and stalls every other request.
            for start in range(0, len(view), CHUNK_SIZE):
                write(view[start : start + CHUNK_SIZE])
                if len(view) > CHUNK_SIZE:
                    await drain()
            await drain()

    def _write_and_drain(
        self,
    ) -> tuple[Callable[[bytes | memoryview], None], Callable[[], Awaitable[None]]]:
        """The channel's write and drain (its protocol's, or its stream writer's);
        ConnectionError once it is closed."""
        protocol = self._protocol
        if protocol is not None:
            if protocol.transport is None or self.closed or protocol.lost:
                raise ConnectionError("IPC connection is closed")
            return protocol.transport.write, protocol.drain
        if self._writer is None or self.closed:
            raise ConnectionError("IPC connection is closed")
        return self._writer.write, self._writer.drain

    async def frames(self) -> AsyncIterator[tuple[int, int, bytes]]:
        """Frames until EOF; FrameError on a corrupt stream, OSError on a read error."""
        if self._protocol is not None:
            async for frame in self._protocol.frames_until_end():
                yield frame
            return
        reader = self._reader
        if reader is None:
            raise ConnectionError("IPC connection was not opened")
        decoder = FrameDecoder(self.max_frame)
        while True:
            data = await reader.read(READ_SIZE)
            if not data:
                if decoder.buffered:
                    raise ConnectionError(
                        f"IPC connection closed inside a frame ({decoder.buffered} bytes pending)"
                    )
                return
            for frame in decoder.feed(data):
                yield frame

    def close(self) -> None:
        self.closed = True
        if self._protocol is not None and self._protocol.transport is not None:
            self._protocol.transport.close()
        elif self._writer is not None:
            self._writer.close()
        elif self.sock is not None:
            self.sock.close()

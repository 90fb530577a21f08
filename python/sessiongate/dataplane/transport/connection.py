"""One end of a framed IPC stream: a reader that yields frames, a writer that never interleaves
the bytes of two frames and never copies a large payload into the event loop in one go."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

from sessiongate.dataplane.transport.frames import CHUNK_SIZE
from sessiongate.primitives import DEFAULT_MAX_FRAME, FrameDecoder, encode_frame_header

READ_SIZE = 256 * 1024


class FrameConnection:
    def __init__(self, sock: socket.socket | None, *, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.sock = sock
        self.max_frame = max_frame
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
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
        self._reader, self._writer = await asyncio.open_unix_connection(
            sock=self.sock, limit=READ_SIZE * 4
        )
        return self

    async def send(
        self, frame_type: int, request_id: int, payload: bytes | memoryview = b""
    ) -> None:
        """Send one frame; FrameTooLarge (for this frame only) when over the cap."""
        header = encode_frame_header(frame_type, request_id, len(payload), max_frame=self.max_frame)
        writer = self._writer
        if writer is None or self.closed:
            raise ConnectionError("IPC connection is closed")
        async with self._write_lock:
            writer.write(header)
            view = memoryview(payload)
            # Hand large payloads to the transport in slices: one huge write() copies the
            # whole payload inside the event loop and stalls every other request.
            for start in range(0, len(view), CHUNK_SIZE):
                writer.write(view[start : start + CHUNK_SIZE])
                if len(view) > CHUNK_SIZE:
                    await writer.drain()
            await writer.drain()

    async def frames(self) -> AsyncIterator[tuple[int, int, bytes]]:
        """Frames until EOF; FrameError on a corrupt stream, OSError on a read error."""
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
        if self._writer is not None:
            self._writer.close()
        elif self.sock is not None:
            self.sock.close()

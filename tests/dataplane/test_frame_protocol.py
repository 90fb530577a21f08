"""The UNIX-socket channel's frame reader (`transport/frame_protocol.py`): frames of any size
across its reused buffer, reading paused while the consumer lags, and the ends of a stream
(clean EOF, EOF inside a frame, a corrupt header, a peer that vanishes mid-write)."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from sessiongate.dataplane.transport.connection import FrameConnection
from sessiongate.dataplane.transport.frame_protocol import PAUSE_AT, READ_SIZE
from sessiongate.primitives import FrameCorrupt, encode_frame_header


async def pair() -> tuple[FrameConnection, FrameConnection]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return await FrameConnection(a).open(), await FrameConnection(b).open()


def test_frames_of_every_size_arrive_whole_and_in_order() -> None:
    sizes = [0, 1, 16, READ_SIZE - 17, READ_SIZE, READ_SIZE + 1, 3 * READ_SIZE + 5, 5 << 20]
    payloads = [os.urandom(size) for size in sizes]

    async def scenario() -> None:
        left, right = await pair()

        async def send_all() -> None:
            for index, payload in enumerate(payloads):
                await left.send(index % 7, index, payload)

        sender = asyncio.create_task(send_all())  # reading is paused past PAUSE_AT
        got = []
        async for frame in right.frames():
            got.append(frame)
            if len(got) == len(payloads):
                break
        assert got == [(i % 7, i, p) for i, p in enumerate(payloads)]
        await sender
        left.close()
        right.close()

    asyncio.run(scenario())


def test_reading_pauses_while_the_consumer_lags_and_resumes() -> None:
    async def scenario() -> None:
        left, right = await pair()
        chunk = os.urandom(READ_SIZE)
        count = 4 * PAUSE_AT // READ_SIZE
        sender = asyncio.ensure_future(
            asyncio.gather(*(left.send(1, i, chunk) for i in range(count)))
        )
        await asyncio.sleep(0.2)  # nothing consumes: the reader fills up to PAUSE_AT, stops
        protocol = right._protocol
        assert protocol is not None and protocol.reading_paused
        assert protocol.queued <= PAUSE_AT + READ_SIZE
        assert not sender.done()  # the sender is held back by the socket, not buffered away
        received = 0
        async for _, rid, payload in right.frames():
            assert rid == received and payload == chunk
            received += 1
            if received == count:
                break
        await sender
        left.close()
        right.close()

    asyncio.run(scenario())


def test_clean_eof_ends_the_frames() -> None:
    async def scenario() -> None:
        left, right = await pair()
        await left.send(2, 9, b"last")
        left.close()
        assert [frame async for frame in right.frames()] == [(2, 9, b"last")]

    asyncio.run(scenario())


def test_eof_inside_a_frame_is_an_error() -> None:
    async def scenario() -> None:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        right = await FrameConnection(b).open()
        a.sendall(encode_frame_header(1, 1, 100) + b"x" * 10)
        a.close()
        with pytest.raises(ConnectionError, match="closed inside a frame"):
            async for _ in right.frames():
                pass

    asyncio.run(scenario())


def test_a_corrupt_header_is_reported_and_closes_the_channel() -> None:
    async def scenario() -> None:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        right = await FrameConnection(b).open()
        a.sendall((3).to_bytes(8, "big") + b"\x00" * 9)
        with pytest.raises(FrameCorrupt, match="below the 9-byte minimum"):
            async for _ in right.frames():
                pass
        a.close()

    asyncio.run(scenario())


def test_a_writer_whose_peer_is_gone_gets_a_connection_error() -> None:
    async def scenario() -> None:
        left, right = await pair()
        right.close()
        with pytest.raises((ConnectionError, OSError)):
            for i in range(64):  # the first writes may still be accepted by the kernel
                await left.send(1, i, b"x" * READ_SIZE)
                await asyncio.sleep(0)
        left.close()

    asyncio.run(scenario())

"""The IPC channel over a real socketpair: multiplexing, streaming with credit, cancel safety,
oversized sends, corrupt frames, EOF and worker-side errors."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessiongate.dataplane.router.worker_channel import WorkerChannel, WorkerFailed, WorkerLost
from sessiongate.dataplane.transport.connection import FrameConnection
from sessiongate.dataplane.transport.frames import CHUNK_SIZE, CREDIT_WINDOW
from sessiongate.dataplane.worker.loop import WorkerLoop
from sessiongate.primitives import FrameTooLarge
from sessiongate.protocol import CoreReply, CoreRequest

Handler = Callable[[CoreRequest], Awaitable[CoreReply]]


async def pair(
    handler: Handler, *, max_frame: int | None = None
) -> tuple[WorkerChannel, WorkerLoop, asyncio.Task[str], socket.socket]:
    router_sock, worker_sock = socket.socketpair()
    kwargs = {"max_frame": max_frame} if max_frame else {}
    channel = WorkerChannel(0, await FrameConnection(router_sock, **kwargs).open())
    worker = WorkerLoop(await FrameConnection(worker_sock).open(), handler, index=0, generation=0)
    serving = asyncio.create_task(worker.run())
    channel.start()
    while not channel.up:
        await asyncio.sleep(0.01)
    return channel, worker, serving, worker_sock


def meta(op: str = "get", **extra: object) -> dict[str, object]:
    return {
        "op": op,
        "session_id": None,
        "path": "",
        "method": "GET",
        "query": "",
        "headers": [],
        **extra,
    }


async def echo(request: CoreRequest) -> CoreReply:
    delay = json.loads(request.body or b"0")
    await asyncio.sleep(delay)
    return CoreReply(200, [("x-op", request.op)], request.body)


def test_replies_match_requests_out_of_order() -> None:
    async def scenario() -> None:
        channel, _, serving, _ = await pair(echo)
        delays = [0.05 * (i % 5) for i in range(40)][::-1]
        replies = await asyncio.gather(
            *(channel.request(meta(f"op{i}"), json.dumps(d).encode()) for i, d in enumerate(delays))
        )
        for index, (delay, reply) in enumerate(zip(delays, replies, strict=True)):
            assert reply.headers == [("x-op", f"op{index}")]
            assert json.loads(reply.body) == delay
        serving.cancel()

    asyncio.run(scenario())


def test_large_body_streams_in_bounded_chunks_with_credit() -> None:
    size = 5 * CHUNK_SIZE + 123
    produced = 0

    async def big(request: CoreRequest) -> CoreReply:
        async def parts() -> AsyncIterator[bytes]:
            nonlocal produced
            for i in range(size // 1000 + 1):
                part = bytes([i % 251]) * min(1000, size - i * 1000)
                produced += len(part)
                yield part

        return CoreReply(200, [], stream=parts(), coalesce=True)

    async def scenario() -> None:
        channel, _, serving, _ = await pair(big)
        reply = await channel.request(meta(), b"")
        assert reply.stream is not None
        received = bytearray()
        async for chunk in reply.stream:
            assert len(chunk) <= CHUNK_SIZE
            received += chunk
            # A slow consumer: the worker may not run more than a window ahead.
            await asyncio.sleep(0.01)
            assert produced - len(received) <= (CREDIT_WINDOW + 1) * CHUNK_SIZE
        assert len(received) == size
        assert received[:1000] == bytes([0]) * 1000
        serving.cancel()

    asyncio.run(scenario())


def test_small_reply_is_not_stuck_behind_a_large_stream() -> None:
    async def mixed(request: CoreRequest) -> CoreReply:
        if request.op == "big":
            return CoreReply(200, [], b"x" * (40 * CHUNK_SIZE))
        return CoreReply(200, [], b"small")

    async def scenario() -> None:
        channel, _, serving, _ = await pair(mixed)
        big = await channel.request(meta("big"), b"")
        assert big.stream is not None
        iterator = big.stream.__aiter__()
        await iterator.__anext__()  # the big stream is now open and stalled on credit
        small = await asyncio.wait_for(channel.request(meta("small"), b""), timeout=5)
        assert small.body == b"small"
        rest = [chunk async for chunk in iterator]
        assert sum(map(len, rest)) == 39 * CHUNK_SIZE
        serving.cancel()

    asyncio.run(scenario())


def test_cancelled_request_never_receives_or_misdelivers() -> None:
    cancelled = asyncio.Event()

    async def slow(request: CoreRequest) -> CoreReply:
        if request.op == "slow":
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                cancelled.set()
                raise
        return CoreReply(200, [], request.op.encode())

    async def scenario() -> None:
        channel, _worker, serving, _ = await pair(slow)
        task = asyncio.create_task(channel.request(meta("slow"), b""))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(cancelled.wait(), timeout=5)
        assert channel.pending == {}
        replies = await asyncio.gather(*(channel.request(meta(f"q{i}"), b"") for i in range(5)))
        assert [r.body for r in replies] == [f"q{i}".encode() for i in range(5)]
        serving.cancel()

    asyncio.run(scenario())


def test_oversized_send_fails_only_that_request() -> None:
    async def scenario() -> None:
        channel, _, serving, _ = await pair(echo, max_frame=64 * 1024)
        with pytest.raises(FrameTooLarge):
            await channel.request(meta(), b"0" * (128 * 1024))
        assert channel.pending == {}
        reply = await channel.request(meta("after"), b"0")
        assert reply.status == 200 and channel.up
        serving.cancel()

    asyncio.run(scenario())


def test_corrupt_frame_fails_every_pending_request_and_closes() -> None:
    async def never(request: CoreRequest) -> CoreReply:
        await asyncio.sleep(30)
        raise AssertionError("unreachable")

    async def scenario() -> None:
        channel, worker, serving, _worker_sock = await pair(never)
        waiting = [asyncio.create_task(channel.request(meta(), b"")) for _ in range(3)]
        await asyncio.sleep(0.05)
        # A length field below the 9-byte minimum: the stream cannot be trusted any more.
        transport = worker.conn._protocol.transport  # type: ignore[union-attr]
        transport.write((3).to_bytes(8, "big") + b"\x00" * 9)
        results = await asyncio.gather(*waiting, return_exceptions=True)
        assert all(isinstance(r, WorkerLost) for r in results)
        assert "corrupt frame" in str(results[0]) and "worker 0" in str(results[0])
        assert not channel.up
        with pytest.raises(WorkerLost):
            await channel.request(meta(), b"")
        serving.cancel()

    asyncio.run(scenario())


def test_eof_fails_pending_requests() -> None:
    async def never(request: CoreRequest) -> CoreReply:
        await asyncio.sleep(30)
        raise AssertionError("unreachable")

    async def scenario() -> None:
        channel, worker, serving, _ = await pair(never)
        waiting = asyncio.create_task(channel.request(meta(), b""))
        await asyncio.sleep(0.05)
        serving.cancel()
        worker.conn.close()
        with pytest.raises(WorkerLost, match="connection closed"):
            await asyncio.wait_for(waiting, timeout=5)

    asyncio.run(scenario())


def test_handler_exception_is_an_error_for_that_request_only() -> None:
    async def flaky(request: CoreRequest) -> CoreReply:
        if request.op == "boom":
            raise RuntimeError("kaput")
        return CoreReply(204, [])

    async def scenario() -> None:
        channel, _, serving, _ = await pair(flaky)
        with pytest.raises(WorkerFailed, match="RuntimeError: kaput"):
            await channel.request(meta("boom"), b"")
        assert (await channel.request(meta("fine"), b"")).status == 204
        serving.cancel()

    asyncio.run(scenario())


@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 3 * CHUNK_SIZE), max_size=6),
    coalesce=st.booleans(),
)
def test_streamed_parts_cross_the_channel_in_chunk_sized_frames(
    sizes: list[int], coalesce: bool
) -> None:
    # A bulk stream's (coalesce) frames are cut at every CHUNK_SIZE of the whole body, large
    # parts as views of themselves; a live stream's parts keep their boundaries (an empty one
    # too), split only past CHUNK_SIZE. Either way the client gets every byte in order.
    parts = [bytes([index % 251]) * size for index, size in enumerate(sizes)]

    async def handler(request: CoreRequest) -> CoreReply:
        async def stream() -> AsyncIterator[bytes]:
            for part in parts:
                yield part

        return CoreReply(200, [], stream=stream(), coalesce=coalesce)

    async def run() -> list[bytes]:
        channel, _, serving, worker_sock = await pair(handler)
        reply = await channel.request(meta(), b"")
        assert reply.stream is not None
        chunks = [chunk async for chunk in reply.stream]
        await channel.aclose()
        worker_sock.close()
        await serving
        return chunks

    chunks = asyncio.run(run())
    body = b"".join(parts)
    assert b"".join(chunks) == body
    if coalesce:
        expected = [body[i : i + CHUNK_SIZE] for i in range(0, len(body), CHUNK_SIZE)]
    else:
        expected = [
            part[i : i + CHUNK_SIZE] for part in parts for i in range(0, len(part) or 1, CHUNK_SIZE)
        ]
    assert chunks == expected

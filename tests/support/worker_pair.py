"""A router's channel and a worker loop over one socketpair, in this process: the data
plane's reply paths (frames, file segments, lent connections) without starting processes."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

from sessiongate.dataplane.router.worker_channel import WorkerChannel
from sessiongate.dataplane.transport.connection import FrameConnection
from sessiongate.dataplane.worker.loop import WorkerLoop
from sessiongate.protocol import CoreReply, CoreRequest


def bulk_reply(parts: list[bytes], pause: float = 0.0) -> CoreReply:
    """A records-GET-like reply: a bulk stream of `parts`, `pause` seconds before each."""

    async def stream() -> AsyncIterator[bytes]:
        for part in parts:
            if pause:
                await asyncio.sleep(pause)
            yield part

    return CoreReply(200, [("content-type", "application/json")], stream=stream(), coalesce=True)


def get_meta() -> dict[str, Any]:
    return {
        "op": "get",
        "session_id": None,
        "method": "GET",
        "path": "/",
        "query": "",
        "headers": [],
    }


async def open_pair(
    reply: CoreReply,
    worker_dir: str | None,
    router_dir: str | None,
    *,
    lend_replies: bool = False,
) -> tuple[WorkerChannel, WorkerLoop, asyncio.Task[str], socket.socket]:
    """A channel whose worker answers every request with `reply`, up (first heartbeat in)."""
    router_sock, worker_sock = socket.socketpair()

    async def handler(request: CoreRequest) -> CoreReply:
        return reply

    channel = WorkerChannel(0, await FrameConnection(router_sock).open(), reply_dir=router_dir)
    worker = WorkerLoop(
        await FrameConnection(worker_sock).open(),
        handler,
        index=0,
        generation=0,
        reply_dir=worker_dir,
        lend_replies=lend_replies,
    )
    serving = asyncio.create_task(worker.run())
    channel.start()
    while not channel.up:
        await asyncio.sleep(0.01)
    return channel, worker, serving, worker_sock


async def close_pair(
    channel: WorkerChannel, serving: asyncio.Task[str], sock: socket.socket
) -> None:
    await channel.aclose()
    sock.close()
    await serving

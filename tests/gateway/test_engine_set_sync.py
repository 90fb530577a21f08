"""A (re)attached worker gets the live engine set before any request (no processes: a
recording stand-in for the worker channel)."""

from __future__ import annotations

import asyncio
import json
from typing import Any, cast

from sessiongate.dataplane.router.shard_router import ShardRouter
from sessiongate.dataplane.router.worker_channel import WorkerChannel
from sessiongate.engines.registry import EngineRegistry
from sessiongate.gateway.shell import GatewayShell
from sessiongate.protocol import CoreReply, CoreRequest, Op


class RecordingChannel:
    """What the router sends a worker, in order; the engine set takes a while to answer."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.up = True
        self.sent: list[tuple[str, bytes]] = []
        self.answered: list[str] = []

    def start(self) -> None:
        pass

    async def aclose(self) -> None:
        pass

    async def request(self, meta: dict[str, Any], body: bytes) -> CoreReply:
        self.sent.append((str(meta["op"]), body))
        if meta["op"] == Op.SET_ENGINES:
            await asyncio.sleep(0.05)  # a worker busy rebuilding its pool
        self.answered.append(str(meta["op"]))
        return CoreReply(200, [], b"{}")


def test_a_restarted_workers_first_request_waits_for_the_engine_set() -> None:
    async def main() -> RecordingChannel:
        router = ShardRouter(1)
        registry = EngineRegistry(["http://127.0.0.1:9"])
        gateway = GatewayShell(router, registry)
        first = RecordingChannel(0)
        router.attach(cast(WorkerChannel, first))
        # The engines changed since start-up (the one --backend engine went): the registry
        # tells the gateway, which sends the set to the live worker.
        await registry.remove(next(iter(registry.engines)))
        assert [op for op, _ in first.sent] == [Op.SET_ENGINES]
        await asyncio.sleep(0.1)
        restarted = RecordingChannel(0)
        router.attach(cast(WorkerChannel, restarted), restarted=True)
        # Sent at once, before the push task has even run.
        reply = await gateway.handle(CoreRequest(Op.PROXY, path="/generate", method="POST"))
        assert reply.status == 200
        return restarted

    channel = asyncio.run(main())
    assert [op for op, _ in channel.sent] == [Op.SET_ENGINES, Op.PROXY]
    assert channel.answered == [Op.SET_ENGINES, Op.PROXY]
    assert json.loads(channel.sent[0][1]) == {"urls": [], "held": []}

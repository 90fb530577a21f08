"""The sessions are here: `serve --workers 0`'s session back end, this process's own core.

The core is the one always-up worker 0 of `/metrics`, and an engine-set change goes straight
to its pool.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sessiongate.engines.hold import HOLD_SETTLE_S
from sessiongate.gateway.metrics import WorkerGauge, reliability_gauges
from sessiongate.protocol import CoreReply, CoreRequest

if TYPE_CHECKING:
    from sessiongate.session.core import SessionCore


class LocalSessions:
    """A `SessionBackend` over one in-process `SessionCore`."""

    worker_restarts = 0

    def __init__(self, core: SessionCore) -> None:
        self.core = core

    async def handle(self, request: CoreRequest) -> CoreReply:
        return await self.core.handle(request)

    async def use_engines(self, urls: list[str], held: list[str]) -> None:
        self.core.upstream.set_urls(urls, held)
        await self.core.upstream.hold.settle(HOLD_SETTLE_S)

    def engine_counts(self) -> list[list[dict[str, object]]]:
        return [self.core.upstream.engine_counts()]

    def gauges(self) -> list[WorkerGauge]:
        core = self.core
        sessions = core.sessions.values()
        pool = core.upstream
        return [
            WorkerGauge(
                index=0,
                up=True,
                sessions=len(sessions),
                inflight=sum(session.inflight for session in sessions),
                bytes_relayed=0,
                affinity_hits=pool.affinity_hits,
                repins=pool.repins,
                upstreams=list(zip(pool.urls, pool.healthy, strict=True)),
                upstream_reliability=reliability_gauges(pool.upstream_states()),
                records_bytes=core.records_bytes,
                max_records_bytes=core.settings.max_records_bytes,
                max_sessions=core.settings.max_sessions,
                sessions_expired=core.sessions_expired,
                rejected=dict(core.rejected),
            )
        ]

    async def aclose(self) -> None:
        await self.core.aclose()

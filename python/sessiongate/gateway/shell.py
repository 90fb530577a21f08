"""The gateway shell: the one request handler of every layout.

`serve --workers 0` keeps its sessions in this process (one `SessionCore`); the sharded
layout keeps them in worker processes behind the router. Everything else a gateway answers
is the same in both and is written here once: request timing and `/metrics`, the engine
management routes, the fan-out routes, and carrying a change of the engine set to the
compiled front and to the sessions. A layout supplies a `SessionBackend` ("where the
sessions are") and is otherwise this class.

Import-light on purpose: the router process uses it without loading the session core.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from sessiongate.config.rl import RlConfig
from sessiongate.engines.fanout import handle_fanout
from sessiongate.engines.hold import FRONT_SETTLE_S
from sessiongate.engines.management import EngineManagement
from sessiongate.engines.registry import EngineRegistry
from sessiongate.errors import GatewayError, RouteNotFound
from sessiongate.gateway.metrics import RouterMetrics, WorkerGauge, engine_gauges
from sessiongate.protocol import CoreReply, CoreRequest, Op, error_reply
from sessiongate.rl.plane import RlPlane

METRICS_HEADERS = [("content-type", "text/plain; version=0.0.4; charset=utf-8")]


class SessionBackend(Protocol):
    """Where the sessions are: this process's core (`LocalSessions`) or the workers behind
    the router (`ShardRouter`)."""

    async def handle(self, request: CoreRequest) -> CoreReply:
        """Answer a session operation or `/health`; errors come back as replies."""
        ...

    async def use_engines(self, urls: list[str], held: list[str]) -> None:
        """The engine set changed: every session pool uses `urls` from now on, and picks
        none of `held` (engines/hold.py)."""
        ...

    def gauges(self) -> list[WorkerGauge]:
        """One gauge per worker (the in-process core is the one always-up worker 0)."""
        ...

    def engine_counts(self) -> Sequence[Sequence[Mapping[str, Any]]]:
        """Per live worker, its pool's per-engine counts (`EnginePool.engine_counts`)."""
        ...

    @property
    def worker_restarts(self) -> int:
        """Workers replaced after they exited (always 0 in-process)."""
        ...

    async def aclose(self) -> None: ...


class FrontDoor(Protocol):
    """What the shell uses of the compiled front (`front/compiled.py`) when it serves the
    port: its counters for `/metrics`, and the engine set its stateless proxy relays to."""

    def stats(self) -> dict[str, Any]: ...
    def use_engines(self, urls: Sequence[str], held: Sequence[str] = ()) -> None: ...


class GatewayShell:
    """The front end's handler: `/metrics`, the engine routes, request timing, and the
    engine set carried to the front and the sessions; every other request goes to
    `sessions`. Owns `engines`: its changes reach both from here."""

    def __init__(
        self,
        sessions: SessionBackend,
        engines: EngineRegistry,
        front: FrontDoor | None = None,
        rl: RlConfig | None = None,
    ) -> None:
        self.sessions = sessions
        self.engines = engines
        self.front = front
        self.management = EngineManagement(engines)
        self.rl = RlPlane(engines, rl or RlConfig())
        # The held engines last sent (engines/hold.py).
        self._held: list[str] = []
        self.metrics = RouterMetrics()
        engines.on_change = self._engines_changed

    def start(self) -> None:
        """Probe the engines from the start (needs a running loop): `/health` must say an
        engine is down before any traffic."""
        self.engines.start()

    async def handle(self, request: CoreRequest) -> CoreReply:
        started = time.perf_counter()
        try:
            reply = await self._answer(request)
        except GatewayError as error:
            reply = error_reply(error)
        self.metrics.observe(request.op, reply.status, time.perf_counter() - started)
        return reply

    async def _answer(self, request: CoreRequest) -> CoreReply:
        if request.op is Op.METRICS:
            return self._render_metrics()
        if request.op is Op.ENGINES:
            return await self.management.handle(request)
        if request.op is Op.FANOUT:
            return await handle_fanout(request, self.engines.urls())
        if request.op is Op.RL:
            return await self.rl.handle(request)
        if request.op is Op.SET_ENGINES:
            # Only the registry sets the engines; no front classifies a request as this op.
            raise RouteNotFound("the engine set is the gateway's to send")
        return await self.sessions.handle(request)

    def _render_metrics(self) -> CoreReply:
        # The compiled front's proxy requests never reach this handler: its counters join.
        front = self.front.stats() if self.front is not None else None
        admitted = [e for e in self.engines.listing() if e.admitted]
        listed = [(e.url, e.healthy) for e in admitted]
        states = {e.url: (e.paused is not None, e.weight_version) for e in admitted}
        engines = engine_gauges(listed, self.sessions.engine_counts(), front, states)
        body = self.metrics.render(
            self.sessions.gauges(),
            front,
            engines,
            worker_restarts=self.sessions.worker_restarts,
        )
        return CoreReply(200, list(METRICS_HEADERS), body)

    async def _engines_changed(self, urls: list[str]) -> None:
        # The front first: its relay is synchronous, so once the workers have the set too
        # (awaited), no pool of the gateway picks a newly held engine.
        held = self.engines.held()
        # The front stops relaying when the first engine is held: only then can it have
        # picked a request for it just before.
        front_stops = bool(held) and not self._held
        self._held = held
        if self.front is not None:
            self.front.use_engines(urls, held)
            if front_stops:
                await asyncio.sleep(FRONT_SETTLE_S)
        await self.sessions.use_engines(urls, held)

    async def aclose(self) -> None:
        await self.engines.aclose()
        await self.sessions.aclose()

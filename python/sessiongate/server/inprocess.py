"""`serve --workers 0`: one process serves HTTP and runs the session core itself.

No router hop and no IPC: a request costs one process's event loop instead of two, which is
what takes the gateway's added latency to the SGLang router's level (docs/performance.md).
The price is the data plane's isolation: all sessions share one core, `/health` shares the
loop with session work (large parses still run in threads with the GIL released), and an
exit takes every session with it. For a sidecar next to one engine, or any deployment where
latency matters more than spreading session work over cores.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from sessiongate.config.gateway import GatewayConfig
from sessiongate.dataplane.router.metrics import (
    LATENCY_BUCKETS,
    RouterMetrics,
    WorkerGauge,
    engine_gauges,
    reliability_gauges,
)
from sessiongate.dataplane.router.shard_router import METRICS_HEADERS
from sessiongate.engines.fanout import handle_fanout
from sessiongate.engines.management import EngineManagement
from sessiongate.engines.registry import EngineRegistry
from sessiongate.front.asgi import FrontendSettings, GatewayApp
from sessiongate.front.compiled import open_front_door, serve_with_front
from sessiongate.front.http_protocol import gateway_protocol
from sessiongate.front.http_server import QuietServer, uvicorn_config
from sessiongate.process.children import listen_problem
from sessiongate.protocol import CoreReply, CoreRequest, Op
from sessiongate.session.core import SessionCore
from sessiongate.session.core_config import CoreConfig
from sessiongate.session.factory import build_core

WATCH_INTERVAL_S = 0.2


class InProcessGateway:
    """The front end's handler: the session core, plus `/metrics` and request timing."""

    def __init__(self, core: SessionCore, *, placeholder: bool = False) -> None:
        self.core = core
        # The engine set is this process's: registrations go straight to the core's pool,
        # and the registry's prober is the core pool's too (one probe per engine).
        pool = core.upstream
        self.engines = EngineRegistry(
            pool.urls,
            placeholder=placeholder,
            on_change=self._engines_changed,
            interval=pool.health_interval,
            health_path=pool.health_path,
            health_timeout=pool.reliability.health_check_timeout_secs,
        )
        pool.fed_by(self.engines.feed)
        self.management = EngineManagement(self.engines)
        # Called with the new set on each change (the compiled front relays to it).
        self.on_engines_changed: Callable[[list[str]], None] | None = None
        self.metrics = RouterMetrics()
        # The compiled front's counters, when it serves the port (its proxy requests never
        # reach this handler).
        self.front_stats: Callable[[], dict[str, Any]] | None = None

    async def handle(self, request: CoreRequest) -> CoreReply:
        started = time.perf_counter()
        if request.op is Op.METRICS:
            front = self.front_stats() if self.front_stats is not None else None
            engines = engine_gauges(
                [(e.url, e.healthy) for e in self.engines.listing() if e.admitted],
                [self.core.upstream.engine_counts()],
                front,
            )
            body = self.metrics.render([self.gauge()], front, engines)
            reply = CoreReply(200, list(METRICS_HEADERS), body)
        elif request.op is Op.ENGINES:
            reply = await self.management.handle(request)
        elif request.op is Op.FANOUT:
            reply = await handle_fanout(request, self.engines.urls())
        elif request.op is Op.SET_ENGINES:
            # Only the registry sets the engines; a client cannot name this op.
            reply = CoreReply(404, [], b"")
        else:
            reply = await self.core.handle(request)
        self.metrics.observe(request.op, reply.status, time.perf_counter() - started)
        return reply

    async def _engines_changed(self, urls: list[str]) -> None:
        if self.on_engines_changed is not None:
            self.on_engines_changed(urls)
        self.core.upstream.set_urls(urls)

    def gauge(self) -> WorkerGauge:
        """The core as the one always-up worker 0 of the metrics."""
        sessions = self.core.sessions.values()
        pool = self.core.upstream
        return WorkerGauge(
            index=0,
            up=True,
            sessions=len(sessions),
            inflight=sum(session.inflight for session in sessions),
            bytes_relayed=0,
            affinity_hits=self.core.upstream.affinity_hits,
            repins=self.core.upstream.repins,
            upstreams=list(zip(pool.urls, pool.healthy, strict=True)),
            upstream_reliability=reliability_gauges(pool.upstream_states()),
            records_bytes=self.core.records_bytes,
            max_records_bytes=self.core.settings.max_records_bytes,
            max_sessions=self.core.settings.max_sessions,
            sessions_expired=self.core.sessions_expired,
            rejected=dict(self.core.rejected),
        )


def run_in_process(
    gateway_config: GatewayConfig,
    frontend: FrontendSettings,
    config: CoreConfig,
    upstream: str,
    watched: Sequence[subprocess.Popen[bytes]] = (),
) -> int:
    """Serve until signalled, or until a `watched` child (the embedded mock engine) exits,
    as the supervisor does for the workers layout; `config` names the live upstream URLs."""
    host, port = gateway_config.listen.host, gateway_config.listen.port
    log_level = gateway_config.log_level
    problem = listen_problem(host, port)
    if problem is not None:
        # uvicorn would fail to bind too, but only log the errno: say it plainly, and before
        # the core (tokenizer, upstream pool) is built.
        print(f"sessiongate: {problem}", file=sys.stderr, flush=True)
        return 1
    door = open_front_door(
        gateway_config,
        frontend,
        config.backends,
        LATENCY_BUCKETS,
        who="sessiongate",
        registered=not config.backends,  # `--backend none`
    )
    listen_port = port
    port = door.port if door is not None else port
    core = build_core(config)
    # With the embedded mock (`watched`), the first registered engine replaces it.
    gateway = InProcessGateway(core, placeholder=bool(watched))
    if door is not None:
        gateway.front_stats = door.stats
        gateway.on_engines_changed = door.use_engines
        gateway.engines.feed(door.probed)
    app = GatewayApp(gateway.handle, frontend)
    protocol = gateway_protocol(frontend.header_timeout)
    server = QuietServer(uvicorn_config(app, host, port, log_level, protocol))

    def ready(port: int) -> None:
        print(
            f"sessiongate serving on http://{host}:{port} (in-process, upstream {upstream})",
            flush=True,
        )

    lost: list[subprocess.Popen[bytes]] = []

    async def watch() -> None:
        while not lost:
            lost.extend(child for child in watched if child.poll() is not None)
            await asyncio.sleep(WATCH_INTERVAL_S)
        child = lost[0]
        print(
            f"sessiongate: child {child.args!r} exited with code {child.returncode}",
            file=sys.stderr,
            flush=True,
        )
        server.request_exit()

    async def main() -> int:
        # Probe the upstreams from the start, not from the first request: /health must say
        # the engine is down even before any traffic.
        core.start()
        gateway.engines.start()
        watcher = asyncio.create_task(watch()) if watched else None
        try:
            code = await serve_with_front(server, door, on_started=ready, default_port=listen_port)
            if code != 0 and not server.started:
                # Lost the race for the port after the check above.
                problem = listen_problem(host, listen_port)
                if problem is not None:
                    print(f"sessiongate: {problem}", file=sys.stderr, flush=True)
        finally:
            if watcher is not None:
                watcher.cancel()
            await gateway.engines.aclose()
            await core.aclose()
        return 1 if lost else code

    return asyncio.run(main())

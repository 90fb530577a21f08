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
from collections.abc import Sequence

from sessiongate.config.gateway import GatewayConfig
from sessiongate.engines.registry import EngineRegistry
from sessiongate.front.asgi import FrontendSettings, GatewayApp
from sessiongate.front.compiled import open_front_door, serve_with_front
from sessiongate.front.http_protocol import gateway_protocol
from sessiongate.front.http_server import QuietServer, uvicorn_config
from sessiongate.gateway.local_sessions import LocalSessions
from sessiongate.gateway.metrics import LATENCY_BUCKETS
from sessiongate.gateway.shell import GatewayShell
from sessiongate.process.children import listen_problem
from sessiongate.process.memory import keep_freed_records_warm
from sessiongate.session.core_config import CoreConfig
from sessiongate.session.factory import build_core

WATCH_INTERVAL_S = 0.2


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
    # Before the front's threads start: they share the one arena from their first malloc.
    keep_freed_records_warm()
    door = open_front_door(
        gateway_config,
        frontend,
        config.engine_urls,
        LATENCY_BUCKETS,
        who="sessiongate",
        registered=not config.engine_urls,  # `--backend none`
    )
    listen_port = port
    port = door.port if door is not None else port
    core = build_core(config)
    # The engine set is this process's: registrations go straight to the core's pool, and
    # the registry's prober is the core pool's and the front's too (one probe per engine).
    # With the embedded mock (`watched`), the first registered engine replaces it.
    pool = core.upstream
    routing = pool.engine_routing
    engines = EngineRegistry(
        pool.urls,
        placeholder=bool(watched),
        interval=pool.health_interval,
        health_path=pool.health_path,
        health_timeout=pool.reliability.health_check_timeout_secs,
        sglang_version=core.tito.tokenizer.sglang_rules.since,  # the rules it renders by
        newest_weights_only=gateway_config.rl.newest_weights_only,
        labels=gateway_config.rl.engine_labels,
        load_interval=routing.load_monitor_interval if routing.reads_loads else None,
    )
    pool.fed_by(engines.feed)
    pool.fed_loads_by(engines.feed_loads)
    if door is not None:
        engines.feed(door.probed)
        engines.feed_loads(door.loads)
    gateway = GatewayShell(LocalSessions(core), engines, front=door, rl=gateway_config.rl)
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
        gateway.start()
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
            await gateway.aclose()
        return 1 if lost else code

    return asyncio.run(main())

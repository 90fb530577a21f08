"""`sessiongate _router`: the router process, started by the supervisor with one inherited
channel socket per local worker (or the endpoints of remote workers) and a control socket
for replacement channels and moved endpoints.

The composition root of the router process: it wires the router package to the placement
package's remote connectors, so it sits beside both (the router never imports placement)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import socket
import sys
from typing import TYPE_CHECKING

from sessiongate.process.children import die_with_parent

if TYPE_CHECKING:
    from sessiongate.config.launch import RouterLaunch
    from sessiongate.dataplane.placement.remote import RemoteSettings
    from sessiongate.dataplane.router.shard_router import RemoteConnector, ShardRouter
    from sessiongate.dataplane.transport.tcp import Endpoint

MODULES_REPORT_ENV = "SESSIONGATE_ROUTER_MODULES_REPORT"


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("_router")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from sessiongate.config.launch import RouterLaunch, read_launch
    from sessiongate.dataplane.router.shard_router import (
        ShardRouter,
        open_channel,
        watch_control_socket,
    )
    from sessiongate.dataplane.transport.reply_files import remove_reply_dir
    from sessiongate.engines.registry import EngineRegistry
    from sessiongate.front.asgi import GatewayApp, frontend_settings
    from sessiongate.front.compiled import open_front_door, serve_with_front
    from sessiongate.front.http_protocol import gateway_protocol
    from sessiongate.front.http_server import QuietServer, uvicorn_config
    from sessiongate.gateway.metrics import LATENCY_BUCKETS
    from sessiongate.gateway.shell import GatewayShell
    from sessiongate.session.core_options import engine_urls

    if not die_with_parent():
        return 0
    launch: RouterLaunch = read_launch(RouterLaunch)
    config = launch.config
    logging.basicConfig(level=config.log_level.upper(), format="router: %(levelname)s %(message)s")
    fds = list(launch.worker_fds)
    remote_settings, endpoints = _remote_settings(launch) if launch.worker_endpoints else (None, [])
    settings = frontend_settings(config)
    backends = engine_urls(config.engines, embedded_mock=False)  # `--backend none`: []
    protocol = gateway_protocol(settings.header_timeout)
    # `--backend none` (not --worker-endpoints, whose engines only the workers know).
    registered = not backends and not launch.worker_endpoints
    door = open_front_door(
        config.replace(listen=dataclasses.replace(config.listen, port=launch.port)),
        settings,
        backends,
        LATENCY_BUCKETS,
        who="router",
        registered=registered,
    )
    routing = config.engines.routing
    router = ShardRouter(
        len(fds) or len(endpoints),
        remotes=_remote_connector(remote_settings, endpoints),
        sticky_headers=routing.routing_key_headers if routing.sticks else None,
    )
    # The static engines are the workers' (the same configuration); with remote workers the
    # router knows none, and sends a set only once one registers.
    reliability = config.engines.reliability
    registry = EngineRegistry(
        backends,
        placeholder=launch.engines_placeholder,
        interval=config.engines.health_interval,
        health_path=reliability.health_check_endpoint,
        health_timeout=reliability.health_check_timeout_secs,
        # serve resolved it (`auto` only with remote workers: each asks its own engines).
        sglang_version=config.sessions.sglang_version,
        newest_weights_only=config.rl.newest_weights_only,
        labels=config.rl.engine_labels,
        # Only the front's policy reads loads here (the workers' pools poll for themselves).
        load_interval=routing.load_monitor_interval
        if routing.reads_loads and door is not None
        else None,
    )
    if door is not None:
        registry.feed(door.probed)  # the front's one prober (it runs none itself)
        registry.feed_loads(door.loads)
    gateway = GatewayShell(router, registry, front=door, rl=config.rl)
    app = GatewayApp(gateway.handle, settings)
    host = config.listen.host
    port = door.port if door is not None else launch.port
    server = QuietServer(uvicorn_config(app, host, port, config.log_level, protocol))
    control = socket.socket(fileno=launch.control_fd)

    def write_modules_report() -> None:
        report = os.environ.get(MODULES_REPORT_ENV)
        if report:
            # Lets a test verify the router never loads the session core or a tokenizer.
            with open(report, "w") as out:
                json.dump(sorted(sys.modules), out)

    def on_started(port: int) -> None:
        print(f"router listening on {host}:{port}", flush=True)
        write_modules_report()

    async def main() -> int:
        gateway.start()
        for index, fd in enumerate(fds):
            channel = await open_channel(index, socket.socket(fileno=fd), 0, launch.reply_dir)
            router.attach(channel)
        router.start()
        watch_control_socket(
            control, router, on_supervisor_gone=server.request_exit, reply_dir=launch.reply_dir
        )
        try:
            return await serve_with_front(
                server, door, default_port=launch.port, on_started=on_started
            )
        finally:
            await gateway.aclose()
            write_modules_report()
            # The supervisor removes it at stop too; this covers a supervisor killed with
            # SIGKILL, whose router notices and exits (its workers follow).
            remove_reply_dir(launch.reply_dir)

    return asyncio.run(main())


def _remote_connector(
    settings: RemoteSettings | None, endpoints: list[Endpoint]
) -> RemoteConnector | None:
    """The connectors of remote worker slots, one per endpoint; None for local workers."""
    if settings is None:
        return None
    from sessiongate.dataplane.placement.remote import RemoteWorker

    def connect(router: ShardRouter, index: int) -> RemoteWorker:
        return RemoteWorker(router, index, endpoints[index], settings)

    return connect


def _remote_settings(launch: RouterLaunch) -> tuple[RemoteSettings, list[Endpoint]]:
    from sessiongate.dataplane.placement.remote import RemoteSettings
    from sessiongate.dataplane.transport.tcp import client_tls_context, load_secret, parse_endpoints

    workers = launch.config.workers
    # The secret comes from a file or the environment, never argv, so it does not show in `ps`.
    try:
        secret = load_secret(launch.secret_file, launch.secret_env)
        endpoints = parse_endpoints(",".join(launch.worker_endpoints))
    except ValueError as exc:
        raise SystemExit(f"router: {exc}") from None
    tls = (
        client_tls_context(workers.tls_ca, workers.tls_insecure)
        if workers.tls_ca or workers.tls_insecure
        else None
    )
    settings = RemoteSettings(
        secret=secret,
        tls=tls,
        server_hostname=workers.tls_server_name,
        heartbeat_timeout=workers.heartbeat_timeout,
    )
    return settings, endpoints

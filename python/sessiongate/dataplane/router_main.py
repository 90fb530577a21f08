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
import socket
import sys
from typing import TYPE_CHECKING

from sessiongate.engines.options import add_engine_arguments
from sessiongate.engines.routing_options import add_engine_routing_arguments
from sessiongate.front.compiled import add_front_arguments
from sessiongate.process.children import die_with_parent
from sessiongate.session.core_options import add_upstream_arguments

if TYPE_CHECKING:
    from sessiongate.dataplane.placement.remote import RemoteSettings
    from sessiongate.dataplane.transport.tcp import Endpoint

MODULES_REPORT_ENV = "SESSIONGATE_ROUTER_MODULES_REPORT"


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("_router")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    workers = parser.add_mutually_exclusive_group(required=True)
    workers.add_argument("--worker-fds", help="comma list, worker 0 first")
    workers.add_argument("--worker-endpoints", help="HOST:PORT comma list, worker 0 first")
    parser.add_argument("--secret-file", default=None, help="file holding the shared secret")
    parser.add_argument("--secret-env", default=None, help="env var holding the shared secret")
    parser.add_argument("--tls-ca", default=None)
    parser.add_argument("--tls-insecure", action="store_true")
    parser.add_argument("--tls-server-name", default=None)
    parser.add_argument("--worker-heartbeat-timeout", type=float, default=10.0)
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--max-body-bytes", type=int, required=True)
    parser.add_argument("--api-key-env", default=None, help="env var holding the API key")
    parser.add_argument("--session-header", action="append", default=None)
    parser.add_argument("--header-timeout", type=float, default=None)
    parser.add_argument("--body-timeout", type=float, default=None)
    parser.add_argument("--log-level", default="warning")
    # The upstreams, for the compiled front's stateless proxy path (the workers have them too).
    add_upstream_arguments(parser, backends="optional")
    add_engine_arguments(parser, router=True)
    add_front_arguments(parser)
    add_engine_routing_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import os

    from sessiongate.dataplane.router.metrics import LATENCY_BUCKETS
    from sessiongate.dataplane.router.shard_router import Router, open_channel, watch_control_socket
    from sessiongate.engines.options import engine_settings
    from sessiongate.engines.registry import EngineRegistry
    from sessiongate.engines.routing_options import reliability_settings
    from sessiongate.front.asgi import FrontendSettings, GatewayApp
    from sessiongate.front.compiled import open_front_door, serve_with_front
    from sessiongate.front.http_protocol import gateway_protocol
    from sessiongate.front.http_server import QuietServer, uvicorn_config
    from sessiongate.front.routes import session_header_names
    from sessiongate.session.core_options import backend_list

    if not die_with_parent():
        return 0
    logging.basicConfig(level=args.log_level.upper(), format="router: %(levelname)s %(message)s")
    fds = [int(fd) for fd in args.worker_fds.split(",")] if args.worker_fds else []
    remote_settings, endpoints = _remote_settings(args) if args.worker_endpoints else (None, [])
    router = Router(len(fds) or len(endpoints))
    # The key travels by environment, not argv, so it does not show in `ps`.
    api_key = os.environ.get(args.api_key_env) if args.api_key_env else None
    engines = engine_settings(args, router=True)
    backends = backend_list(args, embedded_mock=False)  # `--backend none`: []
    settings = FrontendSettings(
        max_body_bytes=args.max_body_bytes,
        api_key=api_key or None,
        admin_key=engines.admin_key,
        session_headers=session_header_names(args.session_header),
    )
    # Unset flags keep FrontendSettings' defaults (`serve` always forwards its values).
    if args.header_timeout is not None:
        settings = dataclasses.replace(settings, header_timeout=args.header_timeout)
    if args.body_timeout is not None:
        settings = dataclasses.replace(settings, body_timeout=args.body_timeout)
    app = GatewayApp(router.handle, settings)
    protocol = gateway_protocol(settings.header_timeout)
    # `--backend none` (not --worker-endpoints, whose engines only the workers know).
    registered = not backends and not args.worker_endpoints
    door = open_front_door(
        args, settings, backends, LATENCY_BUCKETS, who="router", registered=registered
    )
    if door is not None:
        router.front_stats = door.stats
        router.on_engines_changed = door.use_engines
    port = door.port if door is not None else args.port
    server = QuietServer(uvicorn_config(app, args.host, port, args.log_level, protocol))
    control = socket.socket(fileno=args.control_fd)

    def write_modules_report() -> None:
        report = os.environ.get(MODULES_REPORT_ENV)
        if report:
            # Lets a test verify the router never loads the session core or a tokenizer.
            with open(report, "w") as out:
                json.dump(sorted(sys.modules), out)

    def on_started(port: int) -> None:
        print(f"router listening on {args.host}:{port}", flush=True)
        write_modules_report()

    async def main() -> int:
        # The static engines are the workers' --backend (the same argv); with remote workers
        # the router knows none, and sends a set only once one registers.
        reliability = reliability_settings(args)
        registry = EngineRegistry(
            backends,
            placeholder=engines.placeholder,
            interval=args.health_interval,
            health_path=reliability.health_check_endpoint,
            health_timeout=reliability.health_check_timeout_secs,
        )
        if door is not None:
            registry.feed(door.probed)  # the front's one prober (it runs none itself)
        router.use_engines(registry)
        registry.start()
        for index, fd in enumerate(fds):
            router.attach(await open_channel(index, socket.socket(fileno=fd)))
        if remote_settings is not None:
            from sessiongate.dataplane.placement.remote import RemoteWorker

            remotes = [
                RemoteWorker(router, index, endpoint, remote_settings)
                for index, endpoint in enumerate(endpoints)
            ]
            router.remotes = remotes
            for remote in remotes:
                remote.start()
        watch_control_socket(control, router, on_supervisor_gone=server.request_exit)
        try:
            return await serve_with_front(
                server, door, default_port=args.port, on_started=on_started
            )
        finally:
            await router.aclose()
            write_modules_report()

    return asyncio.run(main())


def _remote_settings(args: argparse.Namespace) -> tuple[RemoteSettings, list[Endpoint]]:
    from sessiongate.dataplane.placement.remote import RemoteSettings
    from sessiongate.dataplane.transport.tcp import client_tls_context, load_secret, parse_endpoints

    # The secret comes from a file or the environment, never argv, so it does not show in `ps`.
    try:
        secret = load_secret(args.secret_file, args.secret_env)
        endpoints = parse_endpoints(args.worker_endpoints)
    except ValueError as exc:
        raise SystemExit(f"router: {exc}") from None
    tls = (
        client_tls_context(args.tls_ca, args.tls_insecure)
        if args.tls_ca or args.tls_insecure
        else None
    )
    settings = RemoteSettings(
        secret=secret,
        tls=tls,
        server_hostname=args.tls_server_name,
        heartbeat_timeout=args.worker_heartbeat_timeout,
    )
    return settings, endpoints

"""`sessiongate serve`: the gateway on one port, in front of a backend or the mock engine."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import shlex
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from sessiongate.engines.options import (
    add_engine_arguments,
    engine_argv,
    engine_env,
    engine_settings,
)
from sessiongate.engines.routing_options import (
    engine_routing_argv,
)
from sessiongate.front.asgi import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, FrontendSettings
from sessiongate.front.compiled import (
    add_front_arguments,
    front_argv,
    front_unsupported,
)
from sessiongate.front.http_protocol import DEFAULT_HEADER_TIMEOUT_S
from sessiongate.front.routes import (
    DEFAULT_SESSION_HEADERS,
    NO_SESSION_HEADER,
    session_header_names,
)
from sessiongate.process import ChildProcess, free_port, wait_http_ready
from sessiongate.session.core_config import (
    IN_PROCESS,
    CoreConfig,
    add_session_arguments,
    core_config,
    session_argv,
)
from sessiongate.session.core_options import MOCK_BACKEND, upstream_argv
from sessiongate.session.core_options import backend_list as core_backend_list
from sessiongate.session.store.options import check_store_options

# R3 shape the embedded mock engine uses when --r3 is given without --mock-args.
DEFAULT_MOCK_R3 = ("--r3-layers", "4", "--r3-topk", "2")


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "serve",
        help="run the session gateway",
        description="Run the session gateway. With the default --backend mock it starts the "
        "built-in mock engine as a child process, so it needs no GPU and no network.",
    )
    add_serve_arguments(parser)
    parser.set_defaults(run=run)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    add_session_arguments(parser, embedded_mock=True)
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"largest request body accepted, else 413 ({DEFAULT_MAX_BODY_BYTES})",
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        metavar="SECONDS",
        help="a client must send a request's line and headers within this many seconds of "
        f"connecting (or of its first byte, on a kept-alive connection), else 408 "
        f"({DEFAULT_HEADER_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT_S,
        metavar="SECONDS",
        help="longest silence allowed between the chunks of a request body, else 408 "
        f"({DEFAULT_BODY_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("SESSIONGATE_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $SESSIONGATE_API_KEY; /health "
        "stays open)",
    )
    parser.add_argument(
        "--session-header",
        action="append",
        default=None,
        help="header naming the session on POST /v1/chat/completions (repeatable; default: "
        + ", ".join(DEFAULT_SESSION_HEADERS)
        + f"). '{NO_SESSION_HEADER}': no header makes a session, e.g. behind the rollout "
        "framework's session server, which does TITO itself (docs/deployment.md)",
    )
    parser.add_argument(
        "--mock-args",
        default="",
        help='extra arguments for the embedded mock engine, e.g. "--r3-layers 48 --r3-topk 8"',
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="session worker processes (default: number of cores; with --ray, worker "
        "actors); sessions are sharded over them by blake2b of the root session id. 0: "
        "in-process, one process serves HTTP and runs the session core (least added latency, "
        "one core, no worker isolation)",
    )
    parser.add_argument(
        "--on-worker-exit",
        choices=("restart", "fail"),
        default="restart",
        help="restart a worker that exits and keep serving the other shards (default), or "
        "stop everything and exit non-zero (fail-fast)",
    )
    add_engine_arguments(parser)
    add_remote_arguments(parser)
    add_front_arguments(parser)


def add_remote_arguments(parser: argparse.ArgumentParser) -> None:
    remote = parser.add_argument_group(
        "remote workers",
        "Session workers on other hosts, over authenticated TCP (docs/deployment.md).",
    )
    remote.add_argument(
        "--worker-endpoints",
        metavar="HOST:PORT,...",
        default=None,
        help="route to these `sessiongate worker` processes instead of starting local "
        "workers; the order fixes the shards (keep it for the deployment's lifetime)",
    )
    remote.add_argument(
        "--secret-file",
        default=None,
        help="file with the shared secret of the workers (required with --worker-endpoints)",
    )
    remote.add_argument(
        "--tls-ca",
        default=None,
        metavar="FILE",
        help="connect to the workers over TLS and verify their certificates against FILE",
    )
    remote.add_argument(
        "--tls-insecure",
        action="store_true",
        help="connect over TLS without verifying certificates (stops eavesdroppers, not an "
        "active man in the middle)",
    )
    remote.add_argument(
        "--tls-server-name",
        default=None,
        metavar="NAME",
        help="host name to expect in the workers' certificates (default: each endpoint's host)",
    )
    remote.add_argument(
        "--worker-heartbeat-timeout",
        type=float,
        default=10.0,
        help="reconnect to a remote worker silent for this many seconds (10)",
    )
    remote.add_argument(
        "--ray",
        action="store_true",
        help="place --workers worker actors in a Ray cluster (pip install 'sessiongate[ray]')",
    )
    remote.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="Ray cluster to join (as ray.init(address=...): 'auto', HOST:PORT, ray://...; "
        "'local' starts a private instance; default: $RAY_ADDRESS, else a cluster started on "
        "this machine, else a new local instance)",
    )
    remote.add_argument(
        "--worker-num-cpus",
        type=float,
        default=1.0,
        help="CPUs each Ray worker actor reserves (1)",
    )


def serve_core_config(args: argparse.Namespace) -> CoreConfig:
    """The session options validated once, before anything starts: the in-process core's
    config (its backends replaced by the live URLs once the embedded engine is up), and the
    resolved values `worker_arguments` forwards."""
    embedded_mock_r3(args)  # the embedded engine's R3 shape, before it is validated
    return core_config(args, IN_PROCESS, program="sessiongate serve", backends=backend_list(args))


def worker_arguments(args: argparse.Namespace, upstreams: Sequence[str]) -> list[str]:
    """The session options of every local worker process or Ray worker (after
    serve_core_config), talking to `upstreams`."""
    # Local workers split this machine's memory; Ray actors size for their host.
    return session_argv(args, upstreams, local_workers=args.workers, placed_elsewhere=args.ray)


def frontend_settings_from(args: argparse.Namespace) -> FrontendSettings:
    if args.max_body_bytes < 1:
        raise SystemExit("--max-body-bytes must be >= 1")
    for flag, value in (
        ("--header-timeout", args.header_timeout),
        ("--body-timeout", args.body_timeout),
    ):
        if not (value > 0 and math.isfinite(value)):
            raise SystemExit(f"{flag} must be a finite number of seconds > 0")
    return FrontendSettings(
        max_body_bytes=args.max_body_bytes,
        api_key=args.api_key or None,
        session_headers=session_header_names(args.session_header),
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        admin_key=engine_settings(args).admin_key,
    )


def backend_list(args: argparse.Namespace) -> list[str]:
    """The upstream URLs serve was given, validated; `[MOCK_BACKEND]` by default."""
    return core_backend_list(args, embedded_mock=True)


def _option_value(argv: list[str], flag: str) -> str | None:
    """The value of the last `flag V` or `flag=V` in `argv`, as argparse reads it."""
    value = None
    for index, arg in enumerate(argv):
        if arg == flag and index + 1 < len(argv):
            value = argv[index + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


def embedded_mock_r3(args: argparse.Namespace) -> list[str]:
    """The R3 arguments `serve --r3` adds for the embedded mock engine (none when
    --mock-args shapes R3 itself), and the mock's top-k in `args.r3_topk` unless --r3-topk
    was given: the gateway configures that engine, so it knows its shape before any turn."""
    if not args.r3 or backend_list(args) != [MOCK_BACKEND]:
        return []
    extra = shlex.split(args.mock_args)
    added = [] if "--r3-layers" in extra else list(DEFAULT_MOCK_R3)
    topk = _option_value([*added, *extra], "--r3-topk")
    if args.r3_topk == 0 and topk is not None and topk.isdigit():
        args.r3_topk = int(topk)
    return added


@contextmanager
def backend_urls(args: argparse.Namespace) -> Iterator[tuple[list[str], ChildProcess | None]]:
    """The upstream URLs; for 'mock', a mock engine child process for the duration."""
    backends = backend_list(args)
    if backends != [MOCK_BACKEND]:
        yield backends, None
        return
    port = free_port()
    mock_args = ["mock-engine", "--host", "127.0.0.1", "--port", str(port)]
    if args.tokenizer:
        mock_args += ["--tokenizer", args.tokenizer]
    extra = shlex.split(args.mock_args)
    mock_args += embedded_mock_r3(args)
    child = ChildProcess("mock-engine", [*mock_args, *extra]).start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ready(url + "/health", timeout=60.0, proc=child.proc)
        yield [url], child
    finally:
        child.stop()


def router_arguments(args: argparse.Namespace, frontend: FrontendSettings) -> list[str]:
    router_args = [
        "--max-body-bytes",
        str(frontend.max_body_bytes),
        "--header-timeout",
        repr(frontend.header_timeout),
        "--body-timeout",
        repr(frontend.body_timeout),
        "--log-level",
        args.log_level,
    ]
    for header in frontend.session_headers or (NO_SESSION_HEADER,):
        router_args += ["--session-header", header]
    return [*router_args, *front_argv(args)]


def remote_router_arguments(args: argparse.Namespace, endpoints: str) -> list[str]:
    """The router's options for remote workers (the secret goes separately)."""
    if args.tls_ca and args.tls_insecure:
        raise SystemExit("--tls-ca and --tls-insecure exclude each other")
    if args.worker_heartbeat_timeout <= 0:
        raise SystemExit("--worker-heartbeat-timeout must be > 0")
    return [
        "--worker-endpoints",
        endpoints,
        "--worker-heartbeat-timeout",
        str(args.worker_heartbeat_timeout),
        *(["--tls-ca", args.tls_ca] if args.tls_ca else []),
        *(["--tls-insecure"] if args.tls_insecure else []),
        *(["--tls-server-name", args.tls_server_name] if args.tls_server_name else []),
    ]


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper())
    check_store_options(args)
    if args.worker_endpoints is not None:
        if args.ray:
            raise SystemExit("--worker-endpoints and --ray exclude each other")
        if args.records_dir:
            raise SystemExit(
                "--records-dir belongs to the workers: give each `sessiongate worker` its own"
            )
        return run_remote(args)
    for option in ("secret_file", "tls_ca", "tls_server_name"):
        if getattr(args, option):
            flag = "--" + option.replace("_", "-")
            raise SystemExit(f"{flag} applies to --worker-endpoints only")
    if args.tls_insecure:
        raise SystemExit("--tls-insecure applies to --worker-endpoints only")
    return run_local(args)


def run_remote(args: argparse.Namespace) -> int:
    """A router over standalone workers: no local workers, no embedded engine."""
    from sessiongate.dataplane.placement.supervisor import Supervisor, SupervisorConfig
    from sessiongate.dataplane.transport.tcp import load_secret, parse_endpoints

    try:
        endpoints = parse_endpoints(args.worker_endpoints)
        load_secret(args.secret_file)  # fail here, not in the router
    except ValueError as exc:
        raise SystemExit(f"sessiongate serve: {exc}") from None
    if args.backend or args.mock_args:
        raise SystemExit(
            "with --worker-endpoints the workers have the backends: give --backend to each "
            "`sessiongate worker`, not to serve"
        )
    if args.on_worker_exit == "fail":
        raise SystemExit(
            "--on-worker-exit fail does not apply to --worker-endpoints: the router keeps "
            "serving the other shards and reconnects; restarting workers is the "
            "orchestrator's job"
        )
    if args.front == "compiled":
        raise SystemExit(
            "--front compiled serves stateless requests from the upstreams, which with "
            "--worker-endpoints only the workers know: use --front auto or python"
        )
    if args.workers is not None and args.workers != len(endpoints):
        raise SystemExit(
            f"--workers {args.workers} does not match the {len(endpoints)} --worker-endpoints"
        )
    frontend = frontend_settings_from(args)
    router_args = [
        *router_arguments(args, frontend),
        *remote_router_arguments(args, ",".join(map(str, endpoints))),
        "--secret-file",
        os.path.abspath(args.secret_file),
    ]
    supervisor = Supervisor(
        SupervisorConfig(
            workers=0,
            host=args.host,
            port=args.port,
            worker_args=[],
            router_args=router_args,
            api_key=frontend.api_key,
            require_workers_ready=False,
        )
    )
    return supervisor.run(
        on_ready=f"sessiongate serving on http://{args.host}:{args.port} "
        f"({len(endpoints)} remote workers: {', '.join(map(str, endpoints))})"
    )


def run_local(args: argparse.Namespace) -> int:
    """Local worker processes, or (--ray) worker actors placed by Ray."""
    from sessiongate.dataplane.placement.supervisor import Supervisor, SupervisorConfig

    config = serve_core_config(args)  # validate before starting anything
    frontend = frontend_settings_from(args)
    if args.workers is None:
        args.workers = os.cpu_count() or 1
    if args.workers < 0:
        raise SystemExit("--workers must be >= 0")
    if args.workers == 0 and args.ray:
        raise SystemExit("--workers 0 (in-process) and --ray exclude each other")
    if args.worker_num_cpus < 0:
        raise SystemExit("--worker-num-cpus must be >= 0")
    if not args.ray and args.ray_address:
        raise SystemExit("--ray-address applies to --ray only")
    if args.records_dir and args.ray:
        raise SystemExit(
            "--records-dir keeps records on this host: use it with local workers, or give "
            "each `sessiongate worker` its own --records-dir"
        )
    backends = backend_list(args)  # validate before starting anything
    engine_routing_argv(args)  # validates --policy and its tunables
    if args.front == "compiled":
        urls = [url for url in backends if url != MOCK_BACKEND]  # the mock is plain http
        problem = front_unsupported(urls) if urls else None
        if problem is not None:
            raise SystemExit(f"--front compiled: {problem}; use --front python or auto")
    with backend_urls(args) as (upstreams, mock):
        upstream = ", ".join(upstreams) or "none yet (engines register at run time)"
        watched = [mock.proc] if mock is not None and mock.proc is not None else []
        if args.workers == 0:
            from sessiongate.server.inprocess import run_in_process

            config = dataclasses.replace(config, backends=tuple(upstreams))
            return run_in_process(args, frontend, config, upstream, watched)
        worker_args = worker_arguments(args, upstreams)
        router_args = [
            *router_arguments(args, frontend),
            # The upstreams, for the compiled front's stateless proxy path, and its policy.
            *upstream_argv(args, upstreams),
            *engine_routing_argv(args),
            # The router owns the engine registry; the embedded mock is its placeholder.
            *engine_argv(placeholder=mock is not None),
        ]
        if args.ray:
            return _run_ray(args, worker_args, router_args, frontend, watched, upstream)
        supervisor = Supervisor(
            SupervisorConfig(
                workers=args.workers,
                host=args.host,
                port=args.port,
                worker_args=worker_args,
                router_args=router_args,
                on_worker_exit=args.on_worker_exit,
                api_key=frontend.api_key,
                watched=watched,
                router_env=engine_env(args),
            )
        )
        return supervisor.run(
            on_ready=f"sessiongate serving on http://{args.host}:{args.port} "
            f"({args.workers} workers, upstream {upstream})"
        )


def _run_ray(
    args: argparse.Namespace,
    worker_args: list[str],
    router_args: list[str],
    frontend: FrontendSettings,
    watched: list[subprocess.Popen[bytes]],
    upstream: str,
) -> int:
    from sessiongate.dataplane.placement.ray import RayPlacement
    from sessiongate.dataplane.placement.supervisor import Supervisor, SupervisorConfig
    from sessiongate.dataplane.transport.tcp import SECRET_ENV

    placement = RayPlacement(
        args.workers,
        worker_args,
        address=args.ray_address,
        num_cpus=args.worker_num_cpus,
        restart=args.on_worker_exit == "restart",
    )
    try:
        endpoints = placement.start()
        print(f"sessiongate: Ray placed the workers at {', '.join(endpoints)}", flush=True)
        supervisor = Supervisor(
            SupervisorConfig(
                workers=0,
                host=args.host,
                port=args.port,
                worker_args=[],
                router_args=[
                    *router_args,
                    *remote_router_arguments(args, ",".join(endpoints)),
                    "--secret-env",
                    SECRET_ENV,
                ],
                on_worker_exit=args.on_worker_exit,
                api_key=frontend.api_key,
                watched=watched,
                router_env={SECRET_ENV: placement.secret, **engine_env(args)},
                endpoint_source=placement,
            )
        )
        return supervisor.run(
            on_ready=f"sessiongate serving on http://{args.host}:{args.port} "
            f"({args.workers} Ray workers, upstream {upstream})"
        )
    finally:
        placement.stop()

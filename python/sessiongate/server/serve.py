"""`sessiongate serve`: the gateway on one port, in front of engines or the mock engine."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

from sessiongate.config.cli import add_options, config_from_args, refuse_flags
from sessiongate.config.engines import MOCK_BACKEND
from sessiongate.config.fields import flag_of
from sessiongate.config.gateway import GatewayConfig
from sessiongate.config.launch import RouterLaunch
from sessiongate.config.sessions import SessionsConfig
from sessiongate.config.smg_flags import refusal as smg_refusal
from sessiongate.config.workers import WorkersConfig
from sessiongate.engines.engine_versions import AUTO, choose_sglang_version
from sessiongate.front.asgi import frontend_settings
from sessiongate.front.compiled import front_unsupported
from sessiongate.mock_engine.cli import embedded_argv, embedded_r3_topk
from sessiongate.process import ChildProcess, free_port, wait_http_ready
from sessiongate.session.core_config import IN_PROCESS, CoreConfig, core_config, worker_config
from sessiongate.session.core_options import engine_urls
from sessiongate.session.store.options import check_store_options

SERVE = "serve"


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        SERVE,
        help="run the session gateway",
        description="Run the session gateway. With the default --backend mock it starts the "
        "built-in mock engine as a child process, so it needs no GPU and no network.",
    )
    add_options(parser, SERVE)
    # smg's flags that serve does not take: named with what to write instead (docs/smg-flags.md).
    refuse_flags(parser, smg_refusal)
    parser.set_defaults(run=run)


def serve_config(args: argparse.Namespace) -> GatewayConfig:
    """serve's configuration from its command line (and --config file), with the embedded
    mock engine's R3 shape filled in."""
    return with_embedded_mock_r3(config_from_args(args, SERVE))


def serve_core_config(config: GatewayConfig) -> CoreConfig:
    """The session options validated once, before anything starts: the in-process core's
    config (its engines replaced by the live URLs once the embedded engine is up)."""
    return core_config(config, IN_PROCESS, program="sessiongate serve", engines=engine_list(config))


def engine_list(config: GatewayConfig) -> list[str]:
    """The engine URLs serve was given, validated; `[MOCK_BACKEND]` by default."""
    return engine_urls(config.engines, embedded_mock=True)


def with_embedded_mock_r3(config: GatewayConfig) -> GatewayConfig:
    """The mock's top-k as the R3 top-k when --r3 is on without one: the gateway configures
    that engine, so it knows its shape before any turn."""
    sessions = config.sessions
    if not sessions.r3 or sessions.r3_topk != 0 or engine_list(config) != [MOCK_BACKEND]:
        return config
    topk = embedded_r3_topk(sessions.r3, config.engines.mock_args)
    if topk is None:
        return config
    return config.replace(sessions=dataclasses.replace(sessions, r3_topk=topk))


@contextmanager
def engine_processes(
    config: GatewayConfig,
) -> Iterator[tuple[list[str], ChildProcess | None]]:
    """The engine URLs; for 'mock', a mock engine child process for the duration."""
    engines = engine_list(config)
    if engines != [MOCK_BACKEND]:
        yield engines, None
        return
    port = free_port()
    sessions = config.sessions
    version = sessions.sglang_version if sessions.sglang_version != AUTO else None
    argv = embedded_argv(
        port, sessions.tokenizer, sessions.r3, config.engines.mock_args, sglang_version=version
    )
    child = ChildProcess("mock-engine", argv)
    child.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ready(url + "/health", timeout=60.0, proc=child.proc)
        yield [url], child
    finally:
        child.stop()


def with_sglang_version(config: GatewayConfig, engines: list[str]) -> GatewayConfig:
    """`config` with the SGLang version the prompts render by resolved (`auto`: asked of
    `engines`, engines/engine_versions.py), said in one start-up line; SystemExit when the
    engines disagree. Every worker gets the resolved version, so none asks again."""
    sessions = config.sessions
    flag = flag_of(SessionsConfig, "sglang_version")
    try:
        choice = choose_sglang_version(sessions.sglang_version, engines, flag=flag)
    except ValueError as exc:
        raise SystemExit(f"sessiongate serve: {exc}") from None
    print(f"sessiongate: prompts render by {choice.line}", flush=True)
    return config.replace(sessions=dataclasses.replace(sessions, sglang_version=choice.version))


def check_remote_options(config: GatewayConfig) -> None:
    workers = config.workers
    if workers.tls_ca and workers.tls_insecure:
        raise SystemExit("--tls-ca and --tls-insecure exclude each other")
    if workers.heartbeat_timeout <= 0:
        raise SystemExit("--worker-heartbeat-timeout must be > 0")


def run(args: argparse.Namespace) -> int:
    config = serve_config(args)
    if args.print_config:
        from sessiongate.config.files import render_toml

        print(render_toml(config, SERVE), end="")
        return 0
    logging.basicConfig(level=config.log_level.upper())
    check_store_options(config.records)
    workers = config.workers
    if workers.endpoints is not None:
        if workers.ray:
            raise SystemExit("--worker-endpoints and --ray exclude each other")
        if config.records.dir:
            raise SystemExit(
                "--records-dir belongs to the workers: give each `sessiongate worker` its own"
            )
        return run_remote(config)
    for name in ("secret_file", "tls_ca", "tls_server_name"):
        if getattr(workers, name):
            flag = flag_of(WorkersConfig, name)
            raise SystemExit(f"{flag} applies to --worker-endpoints only")
    if workers.tls_insecure:
        raise SystemExit("--tls-insecure applies to --worker-endpoints only")
    return run_local(config)


def run_remote(config: GatewayConfig) -> int:
    """A router over standalone workers: no local workers, no embedded engine."""
    from sessiongate.dataplane.placement.supervisor import Supervisor, SupervisorConfig
    from sessiongate.dataplane.transport.tcp import load_secret, parse_endpoints

    workers = config.workers
    assert workers.endpoints is not None
    try:
        endpoints = parse_endpoints(workers.endpoints)
        load_secret(workers.secret_file)  # fail here, not in the router
    except ValueError as exc:
        raise SystemExit(f"sessiongate serve: {exc}") from None
    if config.engines.urls or config.engines.mock_args:
        raise SystemExit(
            "with --worker-endpoints the workers have the engines: give --backend to each "
            "`sessiongate worker`, not to serve"
        )
    if workers.on_exit == "fail":
        raise SystemExit(
            "--on-worker-exit fail does not apply to --worker-endpoints: the router keeps "
            "serving the other shards and reconnects; restarting workers is the "
            "orchestrator's job"
        )
    if config.front.front == "compiled":
        raise SystemExit(
            "--front compiled serves stateless requests from the engines, which with "
            "--worker-endpoints only the workers know: use --front auto or python"
        )
    if workers.count is not None and workers.count != len(endpoints):
        raise SystemExit(
            f"--workers {workers.count} does not match the {len(endpoints)} --worker-endpoints"
        )
    frontend_settings(config)  # validate before starting anything
    check_remote_options(config)
    assert workers.secret_file is not None
    router = RouterLaunch(
        config=config,
        port=config.listen.port,
        control_fd=-1,
        worker_endpoints=tuple(map(str, endpoints)),
        secret_file=os.path.abspath(workers.secret_file),
    )
    supervisor = Supervisor(
        SupervisorConfig(
            workers=0,
            router=router,
            worker_config=None,
            require_workers_ready=False,
        )
    )
    return supervisor.run(
        on_ready=f"sessiongate serving on http://{config.listen.host}:{config.listen.port} "
        f"({len(endpoints)} remote workers: {', '.join(map(str, endpoints))})"
    )


def check_local_options(config: GatewayConfig, count: int) -> None:
    workers = config.workers
    if count < 0:
        raise SystemExit("--workers must be >= 0")
    if count == 0 and workers.ray:
        raise SystemExit("--workers 0 (in-process) and --ray exclude each other")
    if workers.num_cpus < 0:
        raise SystemExit("--worker-num-cpus must be >= 0")
    if not workers.ray and workers.ray_address:
        raise SystemExit("--ray-address applies to --ray only")
    if config.records.dir and workers.ray:
        raise SystemExit(
            "--records-dir keeps records on this host: use it with local workers, or give "
            "each `sessiongate worker` its own --records-dir"
        )
    if config.front.front == "compiled":
        urls = [url for url in engine_list(config) if url != MOCK_BACKEND]  # the mock: http
        problem = front_unsupported(urls) if urls else None
        if problem is not None:
            raise SystemExit(f"--front compiled: {problem}; use --front python or auto")


def run_local(config: GatewayConfig) -> int:
    """Local worker processes, or (--ray) worker actors placed by Ray."""
    from sessiongate.dataplane.placement.supervisor import Supervisor, SupervisorConfig

    core = serve_core_config(config)  # validate before starting anything
    frontend = frontend_settings(config)
    count = config.workers.count
    if count is None:
        count = os.cpu_count() or 1
    check_local_options(config, count)
    with engine_processes(config) as (engines, mock):
        described = ", ".join(engines) or "none yet (engines register at run time)"
        watched = [mock.proc] if mock is not None and mock.proc is not None else []
        # The live engine URLs (the embedded mock's once it is up), for every child.
        live = with_sglang_version(
            config.replace(
                engines=dataclasses.replace(
                    config.engines, urls=tuple(engines) or None, mock_args=""
                )
            ),
            engines,
        )
        if count == 0:
            from sessiongate.server.inprocess import run_in_process

            core = dataclasses.replace(
                core, engine_urls=tuple(engines), sglang_version=live.sessions.sglang_version
            )
            return run_in_process(live, frontend, core, described, watched)
        for_workers = worker_config(
            live, engines, local_workers=count, placed_elsewhere=config.workers.ray
        )
        # The router owns the engine registry; the embedded mock is its placeholder.
        router = RouterLaunch(
            config=for_workers.replace(engines=live.engines),
            port=config.listen.port,
            control_fd=-1,
            engines_placeholder=mock is not None,
        )
        if config.workers.ray:
            return _run_ray(config, count, for_workers, router, watched, described)
        supervisor = Supervisor(
            SupervisorConfig(
                workers=count,
                router=router,
                worker_config=for_workers,
                on_worker_exit=config.workers.on_exit,
                watched=watched,
            )
        )
        return supervisor.run(
            on_ready=f"sessiongate serving on http://{config.listen.host}:{config.listen.port} "
            f"({count} workers, upstream {described})"
        )


def _run_ray(
    config: GatewayConfig,
    count: int,
    for_workers: GatewayConfig,
    router: RouterLaunch,
    watched: list[subprocess.Popen[bytes]],
    described: str,
) -> int:
    from sessiongate.dataplane.placement.ray import RayPlacement
    from sessiongate.dataplane.placement.supervisor import Supervisor, SupervisorConfig
    from sessiongate.dataplane.transport.tcp import SECRET_ENV

    check_remote_options(config)
    placement = RayPlacement(
        count,
        for_workers,
        address=config.workers.ray_address,
        num_cpus=config.workers.num_cpus,
        restart=config.workers.on_exit == "restart",
    )
    try:
        endpoints = placement.start()
        print(f"sessiongate: Ray placed the workers at {', '.join(endpoints)}", flush=True)
        supervisor = Supervisor(
            SupervisorConfig(
                workers=0,
                router=dataclasses.replace(
                    router, worker_endpoints=tuple(endpoints), secret_env=SECRET_ENV
                ),
                worker_config=None,
                on_worker_exit=config.workers.on_exit,
                watched=watched,
                router_env={SECRET_ENV: placement.secret},
                endpoint_source=placement,
            )
        )
        return supervisor.run(
            on_ready=f"sessiongate serving on http://{config.listen.host}:{config.listen.port} "
            f"({count} Ray workers, upstream {described})"
        )
    finally:
        placement.stop()

"""`sessiongate serve`: the gateway on one port, in front of a backend or the mock engine."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
from collections.abc import Iterator
from contextlib import contextmanager

from sessiongate.process import ChildProcess, free_port, wait_http_ready
from sessiongate.process.http_server import QuietServer, serve_until_exit, uvicorn_config
from sessiongate.server.asgi import DEFAULT_MAX_BODY_BYTES, FrontendSettings
from sessiongate.server.routes import DEFAULT_SESSION_HEADERS
from sessiongate.session.settings import DEFAULT_APPEND_ROLES, SessionSettings

MOCK_BACKEND = "mock"
# R3 shape the embedded mock engine uses when --r3 is given without --mock-args.
DEFAULT_MOCK_R3 = ("--r3-layers", "4", "--r3-topk", "2")


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
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
    parser.add_argument(
        "--backend",
        default=MOCK_BACKEND,
        help="upstream base URL (an SGLang-style engine or router), or 'mock' (default) "
        "to start the built-in mock engine",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="local Hugging Face tokenizer directory (default: the built-in tokenizer)",
    )
    parser.add_argument("--r3", action="store_true", help="ask the upstream for routed experts")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="upstream timeout in seconds (600)"
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"largest request body accepted, else 413 ({DEFAULT_MAX_BODY_BYTES})",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("SESSIONGATE_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $SESSIONGATE_API_KEY; /health "
        "stays open)",
    )
    parser.add_argument(
        "--allowed-append-roles",
        default=",".join(sorted(DEFAULT_APPEND_ROLES)),
        help="roles an agent may append after an assistant turn (comma list; tool,user)",
    )
    parser.add_argument(
        "--max-trim-tokens",
        type=int,
        default=0,
        help="trailing checkpoint tokens allowed to differ in the next turn (0)",
    )
    parser.add_argument(
        "--session-header",
        action="append",
        default=None,
        help="header naming the session on POST /v1/chat/completions (repeatable; default: "
        + ", ".join(DEFAULT_SESSION_HEADERS)
        + ")",
    )
    parser.add_argument(
        "--mock-args",
        default="",
        help='extra arguments for the embedded mock engine, e.g. "--r3-layers 48 --r3-topk 8"',
    )
    parser.add_argument("--log-level", default="warning")


def session_settings_from(args: argparse.Namespace) -> SessionSettings:
    roles = frozenset(r.strip() for r in args.allowed_append_roles.split(",") if r.strip())
    if not roles:
        raise SystemExit("--allowed-append-roles must name at least one role")
    if args.max_trim_tokens < 0:
        raise SystemExit("--max-trim-tokens must be >= 0")
    return SessionSettings(
        allowed_append_roles=roles, max_trim_tokens=args.max_trim_tokens, r3=args.r3
    )


def frontend_settings_from(args: argparse.Namespace) -> FrontendSettings:
    if args.max_body_bytes < 1:
        raise SystemExit("--max-body-bytes must be >= 1")
    return FrontendSettings(
        max_body_bytes=args.max_body_bytes,
        api_key=args.api_key or None,
        session_headers=tuple(args.session_header or DEFAULT_SESSION_HEADERS),
    )


@contextmanager
def backend_url(args: argparse.Namespace) -> Iterator[str]:
    """The upstream URL; for 'mock', a mock engine child process for the duration."""
    if args.backend != MOCK_BACKEND:
        yield args.backend
        return
    port = free_port()
    mock_args = ["mock-engine", "--host", "127.0.0.1", "--port", str(port)]
    if args.tokenizer:
        mock_args += ["--tokenizer", args.tokenizer]
    extra = shlex.split(args.mock_args)
    if args.r3 and "--r3-layers" not in extra:
        mock_args += DEFAULT_MOCK_R3
    child = ChildProcess("mock-engine", [*mock_args, *extra]).start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ready(url + "/health", timeout=60.0, proc=child.proc)
        yield url
    finally:
        child.stop()


def run(args: argparse.Namespace) -> int:
    # Imported here so that light subcommands (and the router) never load the tokenizer.
    from sessiongate.server.app import create_app
    from sessiongate.tokenizer import load_tokenizer

    logging.basicConfig(level=args.log_level.upper())
    session_settings = session_settings_from(args)
    frontend_settings = frontend_settings_from(args)
    tokenizer = load_tokenizer(args.tokenizer)
    with backend_url(args) as upstream:
        app, core = create_app(
            tokenizer,
            upstream,
            session_settings=session_settings,
            frontend_settings=frontend_settings,
            upstream_timeout=args.timeout,
        )
        server = QuietServer(uvicorn_config(app, args.host, args.port, args.log_level))

        def announce(port: int) -> None:
            print(
                f"sessiongate serving on http://{args.host}:{port} (upstream {upstream})",
                flush=True,
            )

        async def main() -> int:
            try:
                return await serve_until_exit(server, on_started=announce, default_port=args.port)
            finally:
                await core.aclose()

        code = asyncio.run(main())
    return code

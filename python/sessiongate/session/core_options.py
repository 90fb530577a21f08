"""Command-line options of the session core itself: its upstreams, tokenizer, what a turn may
append, header-session expiry, the session routing mode and the log level. Shared by `serve`,
the worker processes and `sessiongate worker`: declared once, validated once, forwarded to
workers as argv (the other groups: turn_options, tree_options, limit_options,
store/options; core_config.py gathers them all).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, Literal

from sessiongate.session.turn_options import apply_tito_model

# `serve --backend mock` (its default): the embedded mock engine, started by serve itself.
MOCK_BACKEND = "mock"
# `--backend none`: no engine at start; engines register at run time (engines/, docs/api.md
# "Engine management"), turns answer 503 until one is ready.
NO_BACKEND = "none"
# Who declares --backend (add_upstream_arguments).
BackendFlag = Literal["mock", "required", "optional"]


def add_upstream_arguments(parser: argparse.ArgumentParser, *, backends: BackendFlag) -> None:
    """The upstreams and how they are reached. `backends`: "mock" for serve, whose --backend
    defaults to the mock engine it starts; "required" for a worker, which has no engine of
    its own; "optional" for the router, whose compiled front proxies stateless requests."""
    if backends == "mock":
        parser.add_argument(
            "--backend",
            action="append",
            default=None,
            help="upstream base URL (an SGLang-style engine or router); repeat for several "
            "upstreams (each session family is pinned to one, placed by --policy). 'mock' "
            "(the default) starts the built-in mock engine; 'none' starts with no "
            "engine and waits for engines to register (POST /workers or /add_worker)",
        )
    else:
        parser.add_argument(
            "--backend",
            action="append",
            required=backends == "required",
            default=None if backends == "required" else [],
            help="upstream base URL (an SGLang-style engine or router); repeat for several; "
            "'none': no engine until the router sends the registered ones",
        )
    parser.add_argument(
        "--health-interval",
        type=float,
        default=5.0,
        help="seconds between upstream health checks (GET /health; 5)",
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="upstream timeout in seconds (600)"
    )


def upstream_argv(args: argparse.Namespace, backends: Sequence[str]) -> list[str]:
    """The upstream options as argv, for a worker or the router; `backends`: the URLs."""
    return [
        *[arg for url in backends or [NO_BACKEND] for arg in ("--backend", url)],
        "--health-interval",
        str(args.health_interval),
        "--timeout",
        str(args.timeout),
    ]


def add_core_arguments(parser: argparse.ArgumentParser, *, embedded_mock: bool) -> None:
    """`embedded_mock`: serve's (see add_upstream_arguments)."""
    add_upstream_arguments(parser, backends="mock" if embedded_mock else "required")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="local Hugging Face tokenizer directory (default: the built-in tokenizer)",
    )
    parser.add_argument(
        "--allowed-append-roles",
        default=None,
        help="roles an agent may append after an assistant turn (comma list; default: "
        "--tito-model's, else tool,user)",
    )
    parser.add_argument(
        "--max-trim-tokens",
        type=int,
        default=None,
        help="trailing checkpoint tokens allowed to differ in the next turn (default: "
        "--tito-model's, else 0)",
    )
    parser.add_argument(
        "--session-routing",
        default=None,
        metavar="MODE",
        help="stamp session identity onto upstream requests for an external router "
        "(`sessiongate plugins` lists the modes)",
    )
    parser.add_argument(
        "--session-routing-opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of the session routing mode (repeatable)",
    )
    parser.add_argument(
        "--header-session-ttl",
        type=float,
        default=3600.0,
        help="close sessions created by a session header after this many idle seconds "
        "(3600; 0 = never)",
    )
    parser.add_argument("--log-level", default="warning")


def backend_list(args: argparse.Namespace, *, embedded_mock: bool) -> list[str]:
    """The --backend URLs, validated (SystemExit); serve's default is `[MOCK_BACKEND]`."""
    if not embedded_mock:
        if NO_BACKEND in args.backend:
            if len(args.backend) > 1:
                raise SystemExit("--backend none cannot be combined with other --backend URLs")
            return []
        for url in args.backend:
            if not url.startswith(("http://", "https://")):
                raise SystemExit(f"--backend {url!r} must be an http:// or https:// URL")
        return list(args.backend)
    backends: list[str] = args.backend or [MOCK_BACKEND]
    if NO_BACKEND in backends:
        if len(backends) > 1:
            raise SystemExit("--backend none cannot be combined with other --backend URLs")
        return []
    if MOCK_BACKEND in backends and len(backends) > 1:
        raise SystemExit("--backend mock cannot be combined with other --backend URLs")
    for url in backends:
        if url != MOCK_BACKEND and not url.startswith(("http://", "https://")):
            raise SystemExit(f"--backend {url!r} must be an http:// or https:// URL, or 'mock'")
    if len(set(backends)) != len(backends):
        raise SystemExit(f"--backend URLs must be distinct: {backends}")
    return backends


def core_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The SessionSettings fields of these options, validated (SystemExit on bad values).
    Fills --allowed-append-roles and --max-trim-tokens left unset on `args` first, so the
    workers are started with the resolved values."""
    apply_tito_model(args)
    roles = frozenset(r.strip() for r in args.allowed_append_roles.split(",") if r.strip())
    if not roles:
        raise SystemExit("--allowed-append-roles must name at least one role")
    if args.max_trim_tokens < 0:
        raise SystemExit("--max-trim-tokens must be >= 0")
    if args.header_session_ttl < 0:
        raise SystemExit("--header-session-ttl must be >= 0")
    return {
        "allowed_append_roles": roles,
        "max_trim_tokens": args.max_trim_tokens,
        "header_session_ttl": args.header_session_ttl,
    }


def check_session_routing(args: argparse.Namespace, program: str) -> None:
    """Load the routing mode once, so a bad one stops the start with one clear message."""
    from sessiongate.session_routing import RoutingConfigError, load_mode

    try:
        load_mode(args.session_routing, args.session_routing_opt)
    except RoutingConfigError as exc:
        raise SystemExit(f"{program}: {exc}") from None


def core_argv(args: argparse.Namespace, backends: Sequence[str]) -> list[str]:
    """These options as the argv a worker process is started with (after core_settings,
    which resolves the --tito-model defaults); `backends`: the URLs it talks to."""
    return [
        *upstream_argv(args, backends),
        "--allowed-append-roles",
        args.allowed_append_roles,
        "--max-trim-tokens",
        str(args.max_trim_tokens),
        "--header-session-ttl",
        str(args.header_session_ttl),
        *(["--session-routing", args.session_routing] if args.session_routing else []),
        *[arg for opt in args.session_routing_opt for arg in ("--session-routing-opt", opt)],
        "--log-level",
        args.log_level,
        *(["--tokenizer", args.tokenizer] if args.tokenizer else []),
    ]

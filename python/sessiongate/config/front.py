"""The listen and front sections: where `serve` listens and what its HTTP front door
accepts (body limits, client timeouts, keys, the headers that name a session)."""

from __future__ import annotations

from dataclasses import dataclass

from sessiongate.config.fields import ONLY_SERVE, option, section

FRONTS = ("auto", "compiled", "python")
# Largest request body accepted (413 beyond): room for a long agent history with images.
DEFAULT_MAX_BODY_BYTES = 256 * 1024 * 1024
# A client must send a request's line and headers within this many seconds, else 408.
DEFAULT_HEADER_TIMEOUT_S = 10.0
# Longest silence between the chunks of a request body, else 408.
DEFAULT_BODY_TIMEOUT_S = 30.0
# Headers that name a session on POST /v1/chat/completions (the routers' dialects).
DEFAULT_SESSION_HEADERS = (
    "X-Session-ID",
    "X-SMG-Routing-Key",
    "X-Dynamo-Session-ID",
    "X-Correlation-ID",
)
# `--session-header none`: no header makes a session.
NO_SESSION_HEADER = "none"
API_KEY_ENV = "SESSIONGATE_API_KEY"


@section(title="listening", key="listen")
@dataclass(frozen=True)
class ListenConfig:
    host: str = option("--host", default="127.0.0.1", commands=ONLY_SERVE, help="address")
    port: int = option("--port", default=8000, parse=int, commands=ONLY_SERVE, help="port")


@section(title="HTTP front door", key="front")
@dataclass(frozen=True)
class FrontConfig:
    front: str = option(
        "--front",
        default="auto",
        choices=FRONTS,
        commands=ONLY_SERVE,
        help="the HTTP front door: compiled (a Rust server answers stateless proxy requests "
        "itself and hands session traffic to the Python server), python (uvicorn alone), or "
        "auto (compiled when it can serve the configuration: http:// engines known to "
        "this process; default)",
    )
    front_threads: int | None = option(
        "--front-threads",
        parse=int,
        metavar="N",
        commands=ONLY_SERVE,
        help="threads of the compiled front (default: cores, at most 4)",
    )
    max_body_bytes: int = option(
        "--max-body-bytes",
        default=DEFAULT_MAX_BODY_BYTES,
        parse=int,
        commands=ONLY_SERVE,
        help=f"largest request body accepted, else 413 ({DEFAULT_MAX_BODY_BYTES})",
    )
    header_timeout: float = option(
        "--header-timeout",
        default=DEFAULT_HEADER_TIMEOUT_S,
        parse=float,
        metavar="SECONDS",
        commands=ONLY_SERVE,
        help="a client must send a request's line and headers within this many seconds of "
        "connecting (or of its first byte, on a kept-alive connection), else 408 "
        f"({DEFAULT_HEADER_TIMEOUT_S:g})",
    )
    body_timeout: float = option(
        "--body-timeout",
        default=DEFAULT_BODY_TIMEOUT_S,
        parse=float,
        metavar="SECONDS",
        commands=ONLY_SERVE,
        help="longest silence allowed between the chunks of a request body, else 408 "
        f"({DEFAULT_BODY_TIMEOUT_S:g})",
    )
    api_key: str | None = option(
        "--api-key",
        env=API_KEY_ENV,
        secret=True,
        commands=ONLY_SERVE,
        help="require 'Authorization: Bearer KEY' (default: $SESSIONGATE_API_KEY; /health "
        "stays open)",
    )
    session_header: tuple[str, ...] | None = option(
        "--session-header",
        kind="append",
        commands=ONLY_SERVE,
        help="header naming the session on POST /v1/chat/completions (repeatable; default: "
        + ", ".join(DEFAULT_SESSION_HEADERS)
        + f"). '{NO_SESSION_HEADER}': no header makes a session, e.g. behind the rollout "
        "framework's session server, which does TITO itself (docs/deployment.md)",
    )

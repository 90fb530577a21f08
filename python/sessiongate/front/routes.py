"""Map an HTTP request line to a session operation, without reading the body.

Shared by every front end (the in-process app now, the thin router later) so the URL
contract lives in one place.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes

from sessiongate.config.front import DEFAULT_SESSION_HEADERS, NO_SESSION_HEADER
from sessiongate.errors import BadRequest, GatewayError, MethodNotAllowed, RouteNotFound
from sessiongate.primitives import validate_session_id
from sessiongate.protocol import Op

# `--session-header none` (NO_SESSION_HEADER): no header names a session, so every POST
# /v1/chat/completions without a session path is relayed statelessly (behind a session
# server that does TITO).
CHAT_PATH = "/v1/chat/completions"
# The Anthropic Messages session turn (sessiongate.dialects.anthropic): a session path only;
# `/v1/messages` without a session is relayed to the engine, which serves it itself.
MESSAGES_PATH = "/v1/messages"
# The OpenAI Responses session turn (sessiongate.dialects.responses), likewise.
RESPONSES_PATH = "/v1/responses"
# SGLang's native generation route, relayed verbatim like `/v1/...` (the rollout framework's
# rollouts call it through their router).
GENERATE_PATH = "/generate"
# The documented surface (front/openapi.py), answered by the front end itself.
DOCS_PATHS = ("/openapi.json", "/docs")
# The engine management routes of the rollout framework's router client, both dialects
# (engines/management.py): the old `/add_worker`, `/remove_worker`, `/list_workers` and the
# new `/workers`, `/workers/{id}`. Compared after every hot route, like the docs paths.
ENGINE_PATHS = ("/add_worker", "/remove_worker", "/list_workers", "/workers")
ENGINE_PREFIX = "/workers/"
# The Gateway's fan-out routes (engines/fanout.py): every engine's cache flushed, every
# engine's `/metrics` merged. Compared last, like the engine routes.
FANOUT_PATHS = ("/flush_cache", "/engine_metrics")
# smg's RL control plane (rl/plane.py): `/v1/rl` and below, answered by the process that
# owns the engine registry, never relayed to an engine although it is under `/v1/`.
RL_PATH = "/v1/rl"
RL_PREFIX = "/v1/rl/"
# A "%" not followed by two hex digits: `unquote` would keep it as a literal "%".
_BAD_PERCENT = re.compile(r"%(?![0-9A-Fa-f]{2})")


# Methods of the requests the compiled front serves itself (HEAD and the rest go to Python).
FRONT_METHODS = ("GET", "POST")
# Methods of the requests the compiled front passes to Python as requests; the others take
# the whole connection to the Python HTTP server, which answers them (405, HEAD).
DISPATCH_METHODS = ("GET", "POST", "DELETE")
# What RFC 3986 allows in an origin-form target (path and query). Targets with anything else
# go to the Python HTTP server, whose parser decides what they mean.
_TARGET_CHARS = frozenset(string.ascii_letters + string.digits + "-._~!$&'()*+,;=:@/?%")


@dataclass(frozen=True)
class Route:
    op: Op
    session_id: str | None = None
    # Path to use upstream for proxy operations.
    upstream_path: str = ""
    auto_create: bool = False


def session_header_names(values: Sequence[str] | None) -> tuple[str, ...]:
    """The `--session-header` values as the header names to look for: the defaults when
    none is given, none at all for `none` (SystemExit when `none` comes with names)."""
    if not values:
        return DEFAULT_SESSION_HEADERS
    if any(v.lower() == NO_SESSION_HEADER for v in values):
        if len(values) > 1:
            raise SystemExit("--session-header none cannot be combined with header names")
        return ()
    return tuple(values)


def header_session_id(headers: Sequence[tuple[str, str]], names: Sequence[str]) -> str | None:
    """The first configured session header present (header names compare case-insensitively)."""
    lowered = {k.lower(): v for k, v in headers}
    for name in names:
        value = lowered.get(name.lower())
        if value:
            return value
    return None


def decode_path_id(quoted: str) -> str:
    """A session id from its path segment. Ids may contain any visible ASCII; clients
    percent-encode "/", "?", "%" and "#". Malformed escapes (`%zz`, a trailing `%`) and
    escapes that decode to invalid UTF-8 (`%e2%28`) are a 400: `unquote` would silently
    keep the former as literal text and turn the latter into U+FFFD, so a client's broken
    encoder would address some other (missing) session instead of being told."""
    if _BAD_PERCENT.search(quoted):
        raise BadRequest("invalid percent-encoding in the session id (a '%' must start %XX)")
    try:
        # The path is the raw bytes as latin-1 text (asgi.py): get those bytes back.
        raw = quoted.encode("latin-1")
    except UnicodeEncodeError:
        raw = quoted.encode("utf-8")  # an already-decoded path (no raw_path in the scope)
    try:
        session_id = unquote_to_bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(
            "invalid percent-encoding in the session id (it does not decode to UTF-8)"
        ) from exc
    try:
        # Checked here, before any routing, so every front end answers a bad id alike.
        return validate_session_id(session_id)
    except ValueError as exc:
        raise BadRequest(f"invalid session id: {exc}") from exc


def classify(
    method: str,
    path: str,
    headers: Sequence[tuple[str, str]],
    session_headers: Sequence[str] = DEFAULT_SESSION_HEADERS,
) -> Route:
    if path == "/health":
        if method not in ("GET", "HEAD"):
            raise MethodNotAllowed(f"{method} is not allowed on /health (use GET)")
        return Route(Op.HEALTH)
    if path == "/metrics":
        if method not in ("GET", "HEAD"):
            raise MethodNotAllowed(f"{method} is not allowed on /metrics (use GET)")
        return Route(Op.METRICS)
    if path in ("/sessions", "/sessions/"):
        if method != "POST":
            raise MethodNotAllowed(f"{method} is not allowed on /sessions (use POST)")
        return Route(Op.CREATE)
    if path.startswith("/sessions/"):
        rest = path[len("/sessions/") :]
        quoted_id, slash, sub_path = rest.partition("/")
        if not quoted_id:
            raise RouteNotFound("missing session id in the path")
        session_id: str | None = decode_path_id(quoted_id)
        if not slash:
            if method == "GET":
                return Route(Op.GET, session_id)
            if method == "DELETE":
                return Route(Op.DELETE, session_id)
            raise MethodNotAllowed(
                f"{method} is not allowed on /sessions/{{id}} (use GET or DELETE)"
            )
        upstream_path = "/" + sub_path
        if sub_path == "trajectory" and method == "GET":
            return Route(Op.TRAJECTORY, session_id)
        if sub_path == "samples" and method == "POST":
            return Route(Op.SAMPLES, session_id)
        if upstream_path == CHAT_PATH and method == "POST":
            return Route(Op.CHAT, session_id)
        if upstream_path == MESSAGES_PATH and method == "POST":
            return Route(Op.MESSAGES, session_id)
        if upstream_path == RESPONSES_PATH and method == "POST":
            return Route(Op.RESPONSES, session_id)
        return Route(Op.PROXY, session_id, upstream_path=upstream_path)
    if path == CHAT_PATH and method == "POST":
        session_id = header_session_id(headers, session_headers)
        if session_id is not None:
            return Route(Op.CHAT, session_id, auto_create=True)
        return Route(Op.PROXY, None, upstream_path=path)
    if path.startswith("/v1/") or path == GENERATE_PATH:
        if path.startswith(RL_PREFIX) or path == RL_PATH:
            # The method is checked by the plane, which names the ones each route takes.
            return Route(Op.RL)
        return Route(Op.PROXY, None, upstream_path=path)
    # Last, so the hot routes above never pay for these two comparisons.
    if path in DOCS_PATHS:
        if method not in ("GET", "HEAD"):
            raise MethodNotAllowed(f"{method} is not allowed on {path} (use GET)")
        return Route(Op.DOCS)
    if path in ENGINE_PATHS or path.startswith(ENGINE_PREFIX):
        # The method is checked by the handler, which names the ones each path takes.
        return Route(Op.ENGINES)
    if path in FANOUT_PATHS:
        # The method is checked by the handler, as for the engine routes.
        return Route(Op.FANOUT)
    raise RouteNotFound(f"no route for {method} {path}")


def served_by_front(
    method: str,
    path: str,
    headers: Sequence[tuple[str, str]],
    session_headers: Sequence[str] = DEFAULT_SESSION_HEADERS,
) -> bool:
    """Whether the compiled front (`_core.front_route`, rust/front/route.rs) answers this
    request itself: a stateless proxy (no session anywhere) with a method it relays. This is
    the specification; the twin test proves the compiled decision equal to it."""
    if method not in FRONT_METHODS:
        return False
    try:
        route = classify(method, path, headers, session_headers)
    except GatewayError:
        return False
    return route.op is Op.PROXY and route.session_id is None


def front_decision(
    method: str,
    target: str,
    headers: Sequence[tuple[str, str]],
    session_headers: Sequence[str] = DEFAULT_SESSION_HEADERS,
) -> str:
    """What the compiled front does with a request (`_core.front_route`, twinned by
    rust/front/route.rs): "proxy" (it relays it itself), "dispatch" (Python answers it on the
    front's connection, front/dispatched.py) or "handoff" (the connection goes to the
    Python HTTP server). `target` is the request target as sent, query included. The
    transport conditions (HTTP/1.1, a plain Content-Length body, the key) are checked apart
    (rust/front/head.rs): a request that fails them is handed off whatever its route."""
    if not target.startswith("/") or not _TARGET_CHARS.issuperset(target):
        return "handoff"  # an odd target is the Python server's to judge, whatever its route
    path = target.partition("?")[0]
    if served_by_front(method, path, headers, session_headers):
        return "proxy"
    if method not in DISPATCH_METHODS or path in DOCS_PATHS:
        return "handoff"
    if path == RL_PATH or path.startswith(RL_PREFIX):
        # The Python server serves the connection, so a client that leaves is seen and its
        # control calls are cancelled (the front does not watch a dispatched connection).
        return "handoff"
    return "dispatch"

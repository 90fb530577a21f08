"""The OpenAPI 3.1 document (`GET /openapi.json`) and the interactive docs (`GET /docs`).

FastAPI serves this documented, non-hot surface only: the raw ASGI front end (`asgi.py`)
hands it exactly those two paths, so no chat or proxy request ever goes through FastAPI
(docs/architecture.md, "FastAPI for the documented surface"). The routes below are declared
purely so FastAPI generates their schema from the pydantic models in `schemas.py`; their
handlers are never called. Built on the first request for either path, so the router stays
light (tests/dataplane/test_dataplane.py checks it never imports fastapi otherwise).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import Body, FastAPI, Header, Path, Query, Response
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse

from sessiongate.front.schemas import (
    SESSION_ID_PATTERN,
    AnthropicError,
    ChatCompletion,
    ChatCompletionRequest,
    CreateSession,
    ErrorBody,
    Health,
    HealthDown,
    ResponsesError,
    SamplesRequest,
    SessionCreated,
    SessionDump,
)

OPENAPI_PATH = "/openapi.json"
DOCS_PATH = "/docs"
PROXY_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")

# When each gateway status happens; routes pick theirs (docs/api.md, "Errors").
_WHY = {
    400: "Bad request: body not a JSON object, a bad field (named), a bad session id, "
    "a history that does not extend the session, or malformed HTTP.",
    401: "`--api-key` is set and `Authorization: Bearer <key>` is missing or wrong.",
    404: "Unknown, closing or expired session; unknown parent; no such route.",
    410: "The session was deleted within `--reclaimed-ttl` (reclaimed by its trainer).",
    405: "Known path, wrong method.",
    408: "Request headers or body not received in time (`--header-timeout`, `--body-timeout`).",
    413: "Body over `--max-body-bytes`.",
    422: "The session's records cannot be assembled into samples.",
    429: "The worker holds `--max-sessions` already.",
    431: "Request line and headers over 1 MiB.",
    500: "TITO prefix mismatch (names the index), or an unexpected internal error.",
    502: "Upstream transport error, or a reply that breaks the contract; or the worker failed "
    "the request with an internal error.",
    503: "The session's worker is down, or its records fill `--max-records-bytes`.",
    507: "`--records-dir` refused the write (disk full, permissions): nothing was recorded.",
}
# Every request can meet these before it is routed.
_ALWAYS = (400, 401, 408, 413, 431)
_SESSION = (*_ALWAYS, 404, 410, 502, 503)
_RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds to wait: sent when a limit refused the request.",
        "schema": {"type": "integer"},
    }
}
_RECORDED = {
    "X-Sessiongate-Recorded": {
        "description": "`false` when a concurrent turn advanced the session first, so this "
        "turn was answered but not recorded (absent on relayed streams).",
        "schema": {"type": "string", "enum": ["true", "false"]},
    }
}


def _json(model: type) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}


def _errors(*statuses: int, upstream: bool = False) -> dict[int | str, dict[str, Any]]:
    """The gateway's `{"error"}` replies; with `upstream`, also any status the upstream
    answers, passed through with its own body."""
    responses: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        response: dict[str, Any] = {"description": _WHY[status], "model": ErrorBody}
        if status in (429, 503):
            response["headers"] = _RETRY_AFTER
        responses[status] = response
    if upstream:
        responses["default"] = {
            "description": "The upstream's non-200 reply, passed through unchanged.",
            "content": {"*/*": {"schema": {}}},
        }
    return responses


SessionId = Annotated[
    str,
    Path(
        description="1-256 visible ASCII characters, percent-encoded in the path.",
        pattern=SESSION_ID_PATTERN,
    ),
]
ChatBody = Annotated[ChatCompletionRequest, Body()]
FinalHeader = Annotated[
    str | None,
    Header(
        alias="X-Session-Final",
        description="`true`: the session's last turn (session routing modes, docs/routing.md).",
    ),
]
BranchHeader = Annotated[
    str | None,
    Header(
        alias="X-Session-Branch",
        description="`true` or N >= 1: this turn will spawn sub-agent sessions.",
        pattern=r"^(true|false|0|[1-9][0-9]{0,5})$",
    ),
]
_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {
            "type": "string",
            "description": "A `chat.completion.chunk` JSON object; `[DONE]` last; "
            '`{"error": "<message>"}` (and no `[DONE]`) when the turn failed after the 200.',
        }
    },
}
_CHAT_OK: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The upstream's reply minus R3; an SSE stream of "
        "`chat.completion.chunk` events and `data: [DONE]` when `stream` is true.",
        "headers": _RECORDED,
        # OpenAPI before 3.2: a text/event-stream `schema` describes one event.
        "content": {"text/event-stream": {"schema": _SSE_EVENT}},
    }
}


def build_app() -> FastAPI:
    """The FastAPI app that serves /openapi.json and /docs (and nothing else)."""
    app = FastAPI(
        title="sessiongate",
        summary="Session-aware LLM gateway: token-exact (TITO) trajectories of multi-turn "
        "chat sessions, recorded between an agent and its inference engines.",
        description='Errors are `{"error": "<message>"}`. With `--api-key`, every route '
        "but `/health`, `/openapi.json` and `/docs` needs `Authorization: Bearer <key>`. "
        "Session headers (first present wins): `X-Session-ID`, `X-SMG-Routing-Key`, "
        "`X-Dynamo-Session-ID`, `X-Correlation-ID` (`--session-header`). Full reference: "
        "docs/api.md.",
        version=_version(),
        openapi_url=OPENAPI_PATH,
        docs_url=DOCS_PATH,
        redoc_url=None,
    )
    _declare(app)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _finish(
                get_openapi(
                    title=app.title,
                    version=app.version,
                    openapi_version=app.openapi_version,
                    summary=app.summary,
                    description=app.description,
                    routes=app.routes,
                )
            )
        return app.openapi_schema

    # FastAPI's documented hook for a custom schema is assigning the method.
    app.openapi = openapi  # type: ignore[method-assign]
    return app


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sessiongate")
    except PackageNotFoundError:
        return "0"


def _never_called() -> None:
    raise AssertionError("schema-only route: the raw ASGI front end serves it")


def _declare(app: FastAPI) -> None:
    # Declaration order is the order of `paths` in the served document.
    _declare_operations(app)
    _declare_session_routes(app)
    _declare_dialect_routes(app)
    _declare_unscoped_routes(app)


def _declare_operations(app: FastAPI) -> None:
    """/health and /metrics."""

    @app.get(
        "/health",
        tags=["operations"],
        operation_id="health",
        summary="Liveness of the workers and the upstreams (no API key)",
        response_model=Health,
        responses={
            **_errors(400, 405, 408, 413, 431),
            503: {
                "description": "A worker is down; or every upstream is, with `?upstream=required`.",
                "model": HealthDown,
            },
        },
    )
    def health(
        upstream: Annotated[
            Literal["required"] | None,
            Query(
                description="`required`: 503 instead of 200 `degraded` while an upstream "
                "is down (for load balancers)."
            ),
        ] = None,
    ) -> Health:
        _never_called()
        raise AssertionError

    @app.get(
        "/metrics",
        tags=["operations"],
        operation_id="metrics",
        summary="Prometheus metrics",
        response_class=_Text,
        responses={
            200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
            **_errors(401, 405),
        },
    )
    def metrics() -> None:
        _never_called()


def _dialect_errors(model: type, *statuses: int) -> dict[int | str, dict[str, Any]]:
    """A dialect route's errors: the same statuses, in the dialect's own envelope."""
    return {status: {"description": _WHY[status], "model": model} for status in statuses}


_DIALECT_BODY = Annotated[dict[str, Any], Body()]


def _dialect_ok(what: str) -> dict[int | str, dict[str, Any]]:
    return {
        200: {
            "description": what,
            "headers": _RECORDED,
            "content": {
                "application/json": {"schema": {"type": "object"}},
                "text/event-stream": {"schema": {"type": "string"}},
            },
        }
    }


def _declare_dialect_routes(app: FastAPI) -> None:
    """The session turn asked in Anthropic Messages and in OpenAI Responses."""

    @app.post(
        "/sessions/{session_id}/v1/messages",
        tags=["chat"],
        operation_id="sessionMessages",
        summary="One recorded TITO turn asked in Anthropic's Messages API",
        responses={
            **_dialect_ok("A Messages reply; its SSE events when `stream` is true."),
            **_dialect_errors(AnthropicError, *_SESSION, 500, 507),
        },
    )
    def session_messages(session_id: SessionId, body: _DIALECT_BODY) -> None:
        _never_called()

    @app.post(
        "/sessions/{session_id}/v1/responses",
        tags=["chat"],
        operation_id="sessionResponses",
        summary="One recorded TITO turn asked in OpenAI's Responses API",
        responses={
            **_dialect_ok("A Responses object; its `response.*` events when `stream` is true."),
            **_dialect_errors(ResponsesError, *_SESSION, 500, 507),
        },
    )
    def session_responses(session_id: SessionId, body: _DIALECT_BODY) -> None:
        _never_called()


def _declare_session_routes(app: FastAPI) -> None:
    """/sessions and everything under /sessions/{session_id}."""

    @app.post(
        "/sessions",
        tags=["sessions"],
        operation_id="createSession",
        summary="Create a session (a child with `parent_session_id`)",
        response_model=SessionCreated,
        responses=_errors(*_ALWAYS, 404, 429, 502, 503, 507),
    )
    def create_session(body: Annotated[CreateSession | None, Body()] = None) -> SessionCreated:
        _never_called()
        raise AssertionError

    @app.get(
        "/sessions/{session_id}",
        tags=["sessions"],
        operation_id="getSession",
        summary="Records and metadata of a session",
        response_model=SessionDump,
        responses=_errors(*_SESSION),
    )
    def get_session(session_id: SessionId) -> SessionDump:
        _never_called()
        raise AssertionError

    @app.delete(
        "/sessions/{session_id}",
        tags=["sessions"],
        operation_id="deleteSession",
        summary="Close a session (waits for an in-flight turn)",
        status_code=204,
        response_class=_Empty,
        responses=_errors(*_SESSION, 507),
    )
    def delete_session(session_id: SessionId) -> None:
        _never_called()

    @app.post(
        "/sessions/{session_id}/v1/chat/completions",
        tags=["chat"],
        operation_id="sessionChat",
        summary="One recorded TITO turn through the upstream",
        response_model=ChatCompletion,
        responses={**_CHAT_OK, **_errors(*_SESSION, 500, 507, upstream=True)},
    )
    def session_chat(
        session_id: SessionId,
        body: ChatBody,
        final: FinalHeader = None,
        branch: BranchHeader = None,
    ) -> ChatCompletion:
        _never_called()
        raise AssertionError

    @app.get(
        "/sessions/{session_id}/trajectory",
        tags=["sessions"],
        operation_id="getTrajectory",
        summary="The training view as a safetensors file (docs/trajectory.md)",
        response_class=_Binary,
        responses={
            200: {"content": {"application/octet-stream": {"schema": _BINARY}}},
            **_errors(*_SESSION, 500),
        },
    )
    def trajectory(session_id: SessionId) -> None:
        _never_called()

    @app.post(
        "/sessions/{session_id}/samples",
        tags=["sessions"],
        operation_id="getSamples",
        summary="Trainer-ready samples as safetensors (docs/samples.md)",
        response_class=_Binary,
        responses={
            200: {"content": {"application/octet-stream": {"schema": _BINARY}}},
            **_errors(*_SESSION, 422, 500),
        },
    )
    def samples(
        session_id: SessionId, body: Annotated[SamplesRequest | None, Body()] = None
    ) -> None:
        _never_called()

    for method in PROXY_METHODS:
        app.add_api_route(
            "/sessions/{session_id}/{path}",
            _session_proxy,
            methods=[method],
            tags=["proxy"],
            operation_id=f"sessionProxy{method.title()}",
            summary="Plain proxy to the upstream's /{path} (session must exist); not recorded",
            response_class=_Any,
            responses={200: _ANY_REPLY, **_errors(*_SESSION, upstream=True)},
        )


def _declare_unscoped_routes(app: FastAPI) -> None:
    """/v1/chat/completions (session from a header, or none) and the stateless /v1 proxy."""

    @app.post(
        "/v1/chat/completions",
        tags=["chat"],
        operation_id="chat",
        summary="A TITO turn on the session a header names (created on first use); "
        "without one, a stateless proxy",
        response_model=ChatCompletion,
        responses={**_CHAT_OK, **_errors(*_SESSION, 429, 500, 507, upstream=True)},
    )
    def chat(
        body: ChatBody,
        session: Annotated[
            str | None,
            Header(
                alias="X-Session-ID",
                pattern=SESSION_ID_PATTERN,
                description="The session of this turn (or X-SMG-Routing-Key, "
                "X-Dynamo-Session-ID, X-Correlation-ID).",
            ),
        ] = None,
        final: FinalHeader = None,
        branch: BranchHeader = None,
    ) -> ChatCompletion:
        _never_called()
        raise AssertionError

    for method in PROXY_METHODS:
        app.add_api_route(
            "/v1/{path}",
            _stateless_proxy,
            methods=[method],
            tags=["proxy"],
            operation_id=f"proxy{method.title()}",
            summary="Stateless proxy to the upstream's /v1/{path}",
            response_class=_Any,
            responses={200: _ANY_REPLY, **_errors(*_ALWAYS, 502, 503, upstream=True)},
        )


def _session_proxy(session_id: SessionId, path: str) -> None:
    _never_called()


def _stateless_proxy(path: str) -> None:
    _never_called()


def _finish(document: dict[str, Any]) -> dict[str, Any]:
    """FastAPI's document, corrected where it would say something the gateway does not do."""
    components = document.setdefault("components", {})
    schemas = components.get("schemas", {})
    # FastAPI documents its own request validation (422 HTTPValidationError) on every route
    # with parameters; the gateway has no such step (only /samples answers 422, as ErrorBody).
    for path, operations in document["paths"].items():
        for operation in operations.values():
            responses = operation["responses"]
            if not path.endswith("/samples"):
                responses.pop("422", None)
            _json_errors(responses, upstream="default" in responses)
            _object_body(operation)
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    components["securitySchemes"] = {
        "apiKey": {
            "type": "http",
            "scheme": "bearer",
            "description": "The gateway's `--api-key` (only when it is set).",
        }
    }
    for path, operations in document["paths"].items():
        if path != "/health":
            for operation in operations.values():
                # Optional: an empty requirement means a gateway without --api-key is valid.
                operation["security"] = [{"apiKey": []}, {}]
    return document


_ERROR_REF = {"$ref": "#/components/schemas/ErrorBody"}
_UPSTREAM_ERROR = {
    "type": "object",
    "description": "The upstream's own error body, passed through (SGLang: "
    '`{"object": "error", "message", "type", "param", "code"}`).',
}


def _json_errors(responses: dict[str, Any], upstream: bool) -> None:
    """Error bodies are JSON whatever the route's success media type (FastAPI files them under
    the route's response class, e.g. octet-stream on /trajectory). On a route that passes the
    upstream's replies through, a status may also carry the upstream's own error body."""
    for response in responses.values():
        content = response.get("content", {})
        if not any(media.get("schema") == _ERROR_REF for media in content.values()):
            continue
        if upstream:
            response["content"] = {
                "application/json": {"schema": {"anyOf": [_ERROR_REF, _UPSTREAM_ERROR]}},
                # A proxied upstream may answer these statuses in any media type.
                "*/*": {"schema": {}},
            }
        else:
            response["content"] = {"application/json": {"schema": _ERROR_REF}}


def _object_body(operation: dict[str, Any]) -> None:
    """An optional body (`POST /sessions`, `/samples`) may be absent, but when present it must
    be a JSON object: `null` is a 400 like any other non-object."""
    body = operation.get("requestBody")
    if body is None:
        return
    for media in body.get("content", {}).values():
        variants = media.get("schema", {}).get("anyOf")
        if variants:
            kept = [v for v in variants if v.get("type") != "null"]
            if len(kept) == 1:
                media["schema"] = kept[0]


# Response classes only choose the documented media type; they never render anything.
_Text = PlainTextResponse
_Empty = Response
_Any = Response


class _Binary(Response):
    media_type = "application/octet-stream"


_BINARY = {"type": "string", "format": "binary"}
_ANY_REPLY = {
    "description": "The upstream's reply, status and body as received.",
    "content": {"*/*": {"schema": {}}},
}

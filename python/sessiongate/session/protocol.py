"""The operation-level request and reply every front end and worker exchange.

Import-light on purpose: the router uses these without loading the session core.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from sessiongate.session.errors import BadRequest, GatewayError

JSON_HEADERS: list[tuple[str, str]] = [("content-type", "application/json")]
SSE_HEADERS: list[tuple[str, str]] = [
    ("content-type", "text/event-stream"),
    ("cache-control", "no-cache"),
]
RECORDED_HEADER = "x-sessiongate-recorded"


@dataclass
class CoreRequest:
    op: str
    session_id: str | None = None
    path: str = ""
    method: str = "GET"
    query: str = ""
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    # Header-identified sessions (POST /v1/chat/completions) are created on first use.
    auto_create: bool = False


@dataclass
class CoreReply:
    status: int
    headers: list[tuple[str, str]]
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None
    # True for bulk streams (a records dump) whose small parts may be joined into larger
    # chunks; False for live streams (SSE) where each part should go out at once.
    coalesce: bool = False


def json_reply(
    status: int, document: object, headers: list[tuple[str, str]] | None = None
) -> CoreReply:
    body = json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode()
    return CoreReply(status, [*JSON_HEADERS, *(headers or [])], body)


def error_reply(error: GatewayError) -> CoreReply:
    return json_reply(error.status, {"error": error.message})


def parse_json_object(body: bytes, what: str) -> dict[str, Any]:
    try:
        document = json.loads(body)
    except ValueError as exc:
        raise BadRequest(f"{what} is not valid JSON: {exc}") from exc
    if not isinstance(document, dict):
        raise BadRequest(f"{what} must be a JSON object, not {type(document).__name__}")
    return document

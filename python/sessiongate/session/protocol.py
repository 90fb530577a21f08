"""The operation-level request and reply every front end and worker exchange.

Import-light on purpose: the router uses these without loading the session core.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from sessiongate.session.errors import GatewayError

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


def json_reply(
    status: int, document: object, headers: list[tuple[str, str]] | None = None
) -> CoreReply:
    body = json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode()
    return CoreReply(status, [*JSON_HEADERS, *(headers or [])], body)


def error_reply(error: GatewayError) -> CoreReply:
    return json_reply(error.status, {"error": error.message})

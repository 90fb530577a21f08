"""The operation-level request and reply every front end and worker exchange.

Import-light on purpose: the router uses these without loading the session core.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from sessiongate.errors import BadRequest, GatewayError
from sessiongate.json_safety import MAX_JSON_DEPTH, NotUnicode, TooDeep, loads_checked

JSON_HEADERS: list[tuple[str, str]] = [("content-type", "application/json")]
# The rollout framework's fake stream (miles/rollout/session/core.py `_chat_client_response`)
# and SGLang's own stream both say `text/event-stream; charset=utf-8` (Starlette adds the
# charset); `x-accel-buffering: no` keeps a reverse proxy (nginx) from holding events back.
SSE_HEADERS: list[tuple[str, str]] = [
    ("content-type", "text/event-stream; charset=utf-8"),
    ("cache-control", "no-cache"),
    ("x-accel-buffering", "no"),
]
RECORDED_HEADER = "x-sessiongate-recorded"
# The router's `/health` carries this header with the per-run token the supervisor put in
# INSTANCE_ENV, so the supervisor's readiness check cannot be answered by another process
# that happens to listen on the port.
INSTANCE_HEADER = "x-sessiongate-instance"
INSTANCE_ENV = "SESSIONGATE_INSTANCE_TOKEN"


def upstream_required(query: str) -> bool:
    """`GET /health?upstream=required`: 503 instead of 200 "degraded" while every upstream is
    down, for load balancers that should stop routing during an engine outage (docs/api.md)."""
    return "upstream=required" in query.split("&")


class Op(StrEnum):
    """What a request asks the core for. A `str` enum: the value is what crosses the worker
    frames and names the `op` label in `/metrics`, so both stay plain text."""

    HEALTH = "health"
    METRICS = "metrics"
    CREATE = "create"
    GET = "get"
    DELETE = "delete"
    CHAT = "chat"
    # A chat turn asked in another client API (`/sessions/{id}/v1/messages`: Anthropic
    # Messages; sessiongate.dialects): the same TITO turn, converted on the way in and out.
    MESSAGES = "messages"
    # The OpenAI Responses session turn (sessiongate.dialects.responses), likewise.
    RESPONSES = "responses"
    PROXY = "proxy"
    TRAJECTORY = "trajectory"
    SAMPLES = "samples"
    DOCS = "docs"
    # The engine management routes (both dialects of the rollout framework's router client,
    # engines/management.py): answered by the process that owns the engine registry (the
    # in-process gateway, or the router), never by a session worker.
    ENGINES = "engines"
    # The routes that fan out to every engine of the set as the SGLang Model Gateway serves
    # them (`/flush_cache`, `/engine_metrics`; engines/fanout.py): answered by the same
    # process, but guarded by the API key, not the admin key (they change no routing).
    FANOUT = "fanout"
    # smg's RL control plane under `/v1/rl` (rl/plane.py): answered by the process that owns
    # the engine registry, guarded by the admin key like the engine routes.
    RL = "rl"
    # The router's message to a session core: its upstream pool's new engine URLs (body
    # `{"urls": [...]}`); never classified from a client's request.
    SET_ENGINES = "set_engines"


@dataclass
class CoreRequest:
    # An `Op` from the fronts; a worker passes the frame's text on as it came, so a name it
    # does not know reaches the handler (the core answers it with a 400).
    op: str
    session_id: str | None = None
    path: str = ""
    method: str = "GET"
    query: str = ""
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    # Header-identified sessions (POST /v1/chat/completions) are created on first use.
    auto_create: bool = False

    def to_meta(self) -> dict[str, Any]:
        """The request less its body, as the JSON meta of a worker REQUEST frame (the body
        travels beside it as bytes); `from_meta` reads it back."""
        meta: dict[str, Any] = {
            "op": self.op,
            "session_id": self.session_id,
            "path": self.path,
            "method": self.method,
            "query": self.query,
            "headers": [list(h) for h in self.headers],
        }
        if self.auto_create:
            meta["auto_create"] = True
        return meta

    @classmethod
    def from_meta(cls, meta: dict[str, Any], body: bytes) -> CoreRequest:
        """The request a worker REQUEST frame carries: its meta (`to_meta`) and body. The op
        stays the text that came, so a name this side does not know reaches the handler."""
        return cls(
            op=str(meta["op"]),
            session_id=meta.get("session_id"),
            path=str(meta.get("path", "")),
            method=str(meta.get("method", "GET")),
            query=str(meta.get("query", "")),
            headers=[(str(k), str(v)) for k, v in meta.get("headers", [])],
            body=body,
            auto_create=bool(meta.get("auto_create", False)),
        )


class FilePart:
    """A part of a reply body held in an open, already unlinked file of known length (a
    records GET segment a local worker wrote to shared memory: the router never reads it).
    A front that can send files takes the descriptor (`take_fd`); anything else iterates
    its bytes. Its descriptor is closed by `aclose`, by the iteration's end, or when the
    part is dropped unread."""

    READ_SLICE = 256 << 10

    def __init__(self, fd: int, length: int) -> None:
        self.length = length
        self._fd: int | None = fd
        self._offset = 0

    def take_fd(self) -> int:
        """The file descriptor; the caller owns (and closes) it from now on."""
        if self._fd is None:
            raise ValueError("the reply file was already taken or closed")
        fd, self._fd = self._fd, None
        return fd

    def __aiter__(self) -> FilePart:
        return self

    async def __anext__(self) -> bytes:
        if self._fd is None or self._offset >= self.length:
            await self.aclose()
            raise StopAsyncIteration
        left = self.length - self._offset
        chunk = os.pread(self._fd, min(self.READ_SLICE, left), self._offset)
        if not chunk:  # shorter than announced: the reply is cut, not taken as whole
            await self.aclose()
            raise ConnectionError(f"reply file ended at {self._offset} of {self.length} bytes")
        self._offset += len(chunk)
        return chunk

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.close()


class LendOffer:
    """A part of a reply body that its worker offers to write itself on the client's
    connection (a records GET of a local worker: dataplane/transport/lent_replies.py). The
    worker listens on the UNIX socket at `path` for the connection or a refusal. The compiled
    front takes the offer (`DispatchedRequest.lend`); any other front declines it, and the
    body's bytes follow as the stream's next parts. An offer dropped unanswered costs
    nothing: the request's cancel reaches the worker."""

    def __init__(self, path: str) -> None:
        self.path = path

    async def decline(self) -> None:
        """Tell the worker to send the body the usual way; a worker gone is no error (its
        request fails on its own)."""
        peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        peer.setblocking(False)
        try:
            loop = asyncio.get_running_loop()
            await loop.sock_connect(peer, self.path)
            await loop.sock_sendall(peer, LEND_REFUSED)
        except OSError:
            pass
        finally:
            peer.close()


# The byte that declines a LendOffer (rust/front/lend.rs sends it too).
LEND_REFUSED = b"n"


@dataclass
class CoreReply:
    status: int
    headers: list[tuple[str, str]]
    body: bytes = b""
    # Parts of the body; a router's reply may carry FileParts (dataplane/transport/
    # reply_files.py) and a LendOffer (lent_replies.py), what the session core makes is
    # bytes only.
    stream: AsyncIterator[bytes | FilePart | LendOffer] | None = None
    # True for bulk streams (a records dump) whose small parts may be joined into larger
    # chunks; False for live streams (SSE) where each part should go out at once.
    coalesce: bool = False


async def close_stream(stream: object) -> None:
    """Close a reply stream that can be closed (an async generator, a ClosingStream): its
    cleanup ends an upstream exchange or a session turn."""
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


def json_reply(
    status: int, document: object, headers: list[tuple[str, str]] | None = None
) -> CoreReply:
    try:
        body = json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:
        # A lone surrogate (client text echoed in an error): \u escapes are still valid JSON.
        body = json.dumps(document, separators=(",", ":")).encode()
    return CoreReply(status, [*JSON_HEADERS, *(headers or [])], body)


def error_reply(error: GatewayError) -> CoreReply:
    return json_reply(error.status, {"error": error.message})


def parse_json_object(body: bytes, what: str) -> dict[str, Any]:
    """A client's JSON object body, or BadRequest (400) naming what is wrong with it.

    Nesting deeper than MAX_JSON_DEPTH and strings that are not valid Unicode are refused
    here (docs/api.md, "Hostile input"), so no code downstream meets them.
    """
    try:
        document = loads_checked(body)
    except TooDeep as exc:
        raise BadRequest(
            f"{what} is nested too deeply (more than {MAX_JSON_DEPTH} levels of arrays and objects)"
        ) from exc
    except NotUnicode as exc:
        raise BadRequest(
            f"{what}: {exc.where} is not valid Unicode (it holds a lone UTF-16 surrogate such "
            "as \\ud800; text must be encodable as UTF-8)"
        ) from exc
    except ValueError as exc:
        raise BadRequest(f"{what} is not valid JSON: {exc}") from exc
    if not isinstance(document, dict):
        raise BadRequest(f"{what} must be a JSON object, not {type(document).__name__}")
    return document

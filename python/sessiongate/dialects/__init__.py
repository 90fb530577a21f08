"""Client API dialects: request and reply shapes a session turn can be asked in besides
OpenAI chat, each converted to and from the chat body the TITO turn runs on.

Why a layer of its own: a session turn is always a chat turn (the prompt ids, the engine call
on `/v1/chat/completions` with `input_ids`, the record), so another API (Anthropic Messages
now, OpenAI Responses later) only has to say how its body becomes a chat body and how the
engine's chat reply becomes its reply, its stream and its errors. A `Dialect` is those
functions (and, for a dialect whose streams relay the engine's, a `StreamRelay` that converts
chat chunks as they arrive); chat is the identity dialect. Pure functions over parsed JSON:
no I/O, no session state, importable by the front (error envelopes) and the session core
alike.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from sessiongate.dialects.errors import DialectError

# A session's earlier response id -> the stored items it stands for (KeyError: none such).
History = Callable[[str], list[dict[str, Any]]]

__all__ = [
    "CHAT",
    "DIALECT_PATHS",
    "Dialect",
    "DialectError",
    "StreamRelay",
    "dialect_named",
    "dialect_of_path",
]


class StreamRelay(Protocol):
    """One relayed turn's client stream in a dialect, made from the engine's chat chunks as
    they arrive (`--stream-upstream relay`); each method returns whole SSE events."""

    def chunk(self, event: dict[str, Any]) -> list[bytes]:
        """The events for one parsed chat chunk that has choices."""
        ...

    def finish(self, chat_reply: dict[str, Any]) -> list[bytes]:
        """The closing events, once the turn is recorded (`chat_reply`: the turn's reply as
        rebuilt from the stream, as the client's non-stream chat reply)."""
        ...

    def fail(self, message: str) -> list[bytes]:
        """The events that end a stream failed after its 200 (the turn is not recorded)."""
        ...


class Dialect(Protocol):
    """How one client API maps onto a chat turn (docs/api.md, "Dialects")."""

    @property
    def name(self) -> str:
        """Names the dialect in records (`"chat"`, `"anthropic"`)."""
        ...

    @property
    def relays_streams(self) -> bool:
        """Whether a streamed turn may relay the engine's own stream under `--stream-upstream
        relay` (chat: as is; other dialects: through `stream_relay`); a dialect that does
        not streams events made from the buffered reply."""
        ...

    def stream_relay(self, request: dict[str, Any], prompt_tokens: int) -> StreamRelay | None:
        """The converter of a relayed turn's chat chunks (`request`: the client's body;
        `prompt_tokens`: the prompt ids sent); None: the chunks are the client's as is."""
        ...

    def to_chat(self, body: dict[str, Any], history: History | None = None) -> dict[str, Any]:
        """The chat body the turn runs on; DialectError for a body the dialect refuses.
        `history`: the session's earlier responses by id, for a dialect that refers to them
        (Responses' `previous_response_id`)."""
        ...

    def from_chat(self, chat_reply: dict[str, Any], request: dict[str, Any]) -> bytes:
        """The client's reply body from the engine's chat reply (`request`: the client's)."""
        ...

    def stream_events(self, chat_reply: dict[str, Any], request: dict[str, Any]) -> bytes:
        """The client's whole SSE stream from the engine's buffered chat reply."""
        ...

    def error_body(self, status: int, message: str, error_type: str | None = None) -> bytes:
        """The dialect's error envelope for a refusal with this status and message (and the
        dialect's own error type, when the refusal names one)."""
        ...

    def engine_error(self, status: int, body: bytes) -> bytes:
        """The client's body for an engine's error reply to the turn's chat call."""
        ...


# The session paths a dialect answers on (`/sessions/{id}` + path), by dialect name.
DIALECT_PATHS = {"/v1/messages": "anthropic", "/v1/responses": "responses"}


def dialect_of_path(path: str) -> str | None:
    """The dialect whose route `path` is (`/sessions/{id}/v1/messages`), or None. By the
    path alone, so a refusal before the route is known (a bad id, the key, the body limit)
    still gets the dialect's envelope."""
    if not path.startswith("/sessions/"):
        return None
    _, slash, sub_path = path[len("/sessions/") :].partition("/")
    return DIALECT_PATHS.get("/" + sub_path) if slash else None


def compact_json(document: object) -> bytes:
    """JSON as the dialects write it: compact, UTF-8 (pydantic's `model_dump_json` shape)."""
    try:
        return json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:  # a lone surrogate echoed from the client: escape it
        return json.dumps(document, separators=(",", ":")).encode()


@dataclass(frozen=True)
class ChatDialect:
    """OpenAI chat: the identity dialect. The session turn serves its own chat replies (the
    engine's body less R3) and streams; only the error envelope is used from here."""

    name: str = "chat"
    relays_streams: bool = True

    def to_chat(self, body: dict[str, Any], history: History | None = None) -> dict[str, Any]:
        return body

    def from_chat(self, chat_reply: dict[str, Any], request: dict[str, Any]) -> bytes:
        return compact_json(chat_reply)

    def stream_events(self, chat_reply: dict[str, Any], request: dict[str, Any]) -> bytes:
        return b"data: " + compact_json(chat_reply) + b"\n\ndata: [DONE]\n\n"

    def stream_relay(self, request: dict[str, Any], prompt_tokens: int) -> StreamRelay | None:
        return None

    def error_body(self, status: int, message: str, error_type: str | None = None) -> bytes:
        return compact_json({"error": message})

    def engine_error(self, status: int, body: bytes) -> bytes:
        return body


CHAT = ChatDialect()


def dialect_named(name: str) -> Dialect:
    """The dialect of this name (`DIALECT_PATHS`' values, and "chat")."""
    if name == "anthropic":
        from sessiongate.dialects.anthropic import ANTHROPIC

        return ANTHROPIC
    if name == "responses":
        from sessiongate.dialects.responses import RESPONSES

        return RESPONSES
    return CHAT


def gateway_error_in_dialect(name: str, status: int, body: bytes) -> bytes | None:
    """The gateway's own error body (`{"error": "<message>"}`) in the dialect's envelope;
    None for any other body (one the dialect already wrote, an engine's)."""
    if not body.startswith(b'{"error":'):
        return None
    try:
        document = json.loads(body)
    except ValueError:
        return None
    message = document.get("error") if isinstance(document, dict) else None
    if not isinstance(message, str) or len(document) != 1:
        return None
    return dialect_named(name).error_body(status, message)

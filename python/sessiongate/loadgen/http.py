"""One timed HTTP exchange: status, latency, time to first token, bytes, the reply message.

Failures never raise: transport errors, timeouts, non-2xx statuses and 200 replies that
break the chat contract all come back as an `Exchange` with `error_key` set, so a failing
upstream shows up in the error counts instead of ending the run.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from sessiongate.http.client import ConnectFailed, HttpClient, HttpError, Response

ERROR_TEXT_LIMIT = 300  # characters of an error body kept in raw records

BodyHook = Callable[[bytes], Awaitable[None] | None]


@dataclass(slots=True)
class Exchange:
    kind: str  # create | chat | records | delete
    started: float  # time.perf_counter() when the request was sent
    latency_s: float = 0.0
    status: int | None = None  # None: no HTTP answer (transport error, timeout)
    error_key: str | None = None  # "500", "timeout", "connect", "transport", "invalid", ...
    error: str | None = None
    ttft_s: float | None = None
    bytes_sent: int = 0
    bytes_received: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    message: dict[str, Any] | None = None  # assistant message to append to the history
    # JSON reply of non-chat requests, and of non-stream chats (the tree workload's demo
    # reads the sampled ids from its meta_info).
    document: dict[str, Any] | None = None
    response_id: str | None = None  # chat reply's `id`: joins a turn to its tree node
    finish_reason: str | None = None  # chat reply's; "length" closes a tree path
    headers: dict[str, str] = field(default_factory=dict)  # headers the driver added
    body_stamp: dict[str, Any] | None = None  # top-level body keys a routing mode rewrote

    @property
    def ok(self) -> bool:
        return self.error_key is None


def _transport_key(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, ConnectFailed):
        return "connect"
    if isinstance(exc, HttpError | asyncio.IncompleteReadError):
        return "protocol"
    return "transport"


def _assistant_message(message: object) -> dict[str, Any] | None:
    """The reply's message in the shape the next turn sends back (None if unusable)."""
    if not isinstance(message, dict):
        return None
    content = message.get("content")
    tool_calls = message.get("tool_calls")
    if content is None and not tool_calls:
        return None
    out: dict[str, Any] = {"role": "assistant", "content": content or ""}
    # Echoed back as received: a reasoning model's history keeps its thinking (a strict
    # history matcher compares it).
    if isinstance(message.get("reasoning_content"), str):
        out["reasoning_content"] = message["reasoning_content"]
    if tool_calls:
        out["tool_calls"] = tool_calls
    return out


def _usage(document: dict[str, Any], ex: Exchange) -> None:
    usage = document.get("usage")
    if isinstance(usage, dict):
        if isinstance(usage.get("prompt_tokens"), int):
            ex.prompt_tokens = usage["prompt_tokens"]
        if isinstance(usage.get("completion_tokens"), int):
            ex.completion_tokens = usage["completion_tokens"]


def _chat_reply(body: bytes, ex: Exchange) -> None:
    try:
        document = json.loads(body)
        choice = document["choices"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        ex.error_key, ex.error = "invalid", "reply is not a chat completion"
        return
    ex.message = _assistant_message(choice.get("message") if isinstance(choice, dict) else None)
    if ex.message is None:
        ex.error_key, ex.error = "invalid", "reply has no assistant content"
        return
    _usage(document, ex)
    ex.document = document
    _identity(document, choice, ex)


def _identity(document: dict[str, Any], choice: object, ex: Exchange) -> None:
    """The reply id and finish reason, when the reply carries them as strings."""
    if isinstance(document.get("id"), str):
        ex.response_id = document["id"]
    reason = choice.get("finish_reason") if isinstance(choice, dict) else None
    if isinstance(reason, str):
        ex.finish_reason = reason


class _SseState:
    """Accumulates an OpenAI chat stream into one assistant message."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.first_token: float | None = None
        self.done = False

    def feed(self, data: str, ex: Exchange) -> None:
        if data == "[DONE]":
            self.done = True
            return
        chunk = json.loads(data)
        _usage(chunk, ex)
        if ex.response_id is None and isinstance(chunk.get("id"), str):
            ex.response_id = chunk["id"]
        for choice in chunk.get("choices") or []:
            if isinstance(choice.get("finish_reason"), str):
                ex.finish_reason = choice["finish_reason"]
            delta = choice.get("delta") or {}
            text = delta.get("content")
            calls = delta.get("tool_calls")
            if (text or calls) and self.first_token is None:
                self.first_token = time.perf_counter()
            if text:
                self.content.append(text)
            thought = delta.get("reasoning_content")
            if isinstance(thought, str):
                self.reasoning.append(thought)
            for call in calls or []:
                self._merge_call(call)
            meta = choice.get("meta_info")
            if choice.get("finish_reason") and isinstance(meta, dict):
                # sessiongate/mock final chunk: complete meta_info with the token count.
                if isinstance(meta.get("completion_tokens"), int):
                    ex.completion_tokens = meta["completion_tokens"]

    def _merge_call(self, call: dict[str, Any]) -> None:
        # OpenAI streams tool calls in fragments keyed by index; whole calls merge the same.
        index = int(call.get("index", len(self.tool_calls)))
        slot = self.tool_calls.setdefault(
            index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
        )
        if call.get("id"):
            slot["id"] = call["id"]
        function = call.get("function") or {}
        slot["function"]["name"] += function.get("name") or ""
        slot["function"]["arguments"] += function.get("arguments") or ""

    def message(self) -> dict[str, Any] | None:
        calls = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        if not self.content and not calls:
            return None
        out: dict[str, Any] = {"role": "assistant", "content": "".join(self.content)}
        if self.reasoning:
            out["reasoning_content"] = "".join(self.reasoning)
        if calls:
            out["tool_calls"] = calls
        return out


async def _read_stream(response: Response, ex: Exchange) -> None:
    state = _SseState()
    # A bytearray with a scan mark: an event of many MiB (R3 in the final chunk) arrives in
    # many reads, and neither re-joining nor re-scanning the buffer per read may be quadratic.
    buffer = bytearray()
    scanned = 0
    async for chunk in response.iter_raw():
        ex.bytes_received += len(chunk)
        buffer += chunk
        while (end := buffer.find(b"\n", scanned)) >= 0:
            line = bytes(buffer[:end]).rstrip(b"\r")
            del buffer[: end + 1]
            scanned = 0
            if line.startswith(b"data:"):
                try:
                    state.feed(line[5:].strip().decode(), ex)
                except (ValueError, AttributeError, TypeError):
                    ex.error_key, ex.error = "invalid", f"bad SSE event: {line[:120]!r}"
                    return
        scanned = len(buffer)
    if state.first_token is not None:
        ex.ttft_s = state.first_token - ex.started
    ex.message = state.message()
    if not state.done:
        ex.error_key, ex.error = "invalid", "stream ended without data: [DONE]"
    elif ex.message is None:
        ex.error_key, ex.error = "invalid", "stream carried no assistant content"


async def exchange(
    client: HttpClient,
    kind: str,
    method: str,
    url: str,
    *,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float | None = None,
    stream: bool = False,
    body_hook: BodyHook | None = None,
) -> Exchange:
    """Send one request and classify its outcome; never raises for HTTP or network failures.

    `kind == "chat"` parses the reply (SSE when `stream`); other kinds keep a small JSON
    reply as `document`, or stream the body through `body_hook` (records GETs can be GiB).
    """
    sent_headers = dict(headers or {})
    if body is not None:
        sent_headers.setdefault("Content-Type", "application/json")
    ex = Exchange(kind=kind, started=time.perf_counter(), bytes_sent=len(body or b""))
    try:
        # One total deadline per request: connect, send, wait and read together.
        async with asyncio.timeout(timeout):
            async with client.request(method, url, body=body, headers=sent_headers) as reply:
                ex.status = reply.status
                if kind == "chat" and stream and reply.status == 200:
                    await _read_stream(reply, ex)
                elif body_hook is not None and reply.status == 200:
                    async for chunk in reply.iter_raw():
                        ex.bytes_received += len(chunk)
                        pending = body_hook(chunk)
                        if pending is not None:
                            await pending
                else:
                    data = await reply.read()
                    ex.bytes_received = len(data)
                    if not 200 <= reply.status < 300:
                        ex.error_key = str(reply.status)
                        ex.error = data[:ERROR_TEXT_LIMIT].decode(errors="replace")
                    elif kind == "chat":
                        _chat_reply(data, ex)
                    elif data:
                        try:
                            ex.document = json.loads(data)
                        except ValueError:
                            ex.error_key, ex.error = "invalid", "reply is not JSON"
    except (TimeoutError, HttpError, OSError, asyncio.IncompleteReadError) as exc:
        ex.error_key = _transport_key(exc)
        ex.error = f"{type(exc).__name__}: {exc}"[:ERROR_TEXT_LIMIT]
    ex.latency_s = time.perf_counter() - ex.started
    return ex

"""A streamed TITO turn (`--stream-upstream relay`): relay SGLang's SSE events as they
arrive and rebuild the turn's non-stream reply for the record from what SGLang really streams.

What SGLang 0.5.23 streams (serving_chat.py `_generate_chat_stream`; docs/api.md): a first
chunk with the role, content chunks whose `choices[0].logprobs.content` carry each sampled
token's text and logprob (no ids), a finish chunk with `finish_reason` / `matched_stop`, then
chunks with `choices: []`: `sglext` (`output_ids` when asked with
`return_output_ids_in_sglext`, `routed_experts` when asked for R3) and `usage` (with
`stream_options.include_usage`), then `data: [DONE]`. No chunk carries `meta_info`, and
`return_meta_info` with `stream` is a 400. So the worker asks for exactly those extras and
assembles ids (sglext), logprobs and token texts (the deltas), the message (the deltas),
finish reason, token counts and cached tokens (usage) and R3 (sglext). The sglext chunk may
hold 100+ MiB of R3: its base64 is sliced out by a byte search, never parsed in Python.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from sessiongate.errors import UpstreamError
from sessiongate.protocol import close_stream

DONE = b"[DONE]"
# Largest SSE event accepted (an sglext chunk carries all of a turn's R3): past it the
# upstream is broken, and the worker must not buffer without end.
MAX_EVENT_BYTES = 1 << 30
# Events at least this large are searched for R3 before any JSON parsing.
_LARGE_EVENT = 64 * 1024
_R3_KEY = b'"routed_experts"'
# Stands for the R3 text in the rebuilt reply until the bytes are spliced in; the quoted
# member cannot occur unescaped inside any other JSON string.
_R3_PLACEHOLDER = "__sessiongate_r3__"
_R3_MEMBER = b'"routed_experts":"' + _R3_PLACEHOLDER.encode() + b'"'


class SseEvents:
    """Splits a byte stream into SSE `data` payloads; fed pieces as they arrive.

    Events end at a blank line (`\\n\\n`; `\\r\\n` line ends are accepted). Lines other than
    `data:` (comments, `event:`, `id:`) are skipped; several `data:` lines of one event are
    joined with `\\n`, as the SSE format says.
    """

    def __init__(self, max_event: int = MAX_EVENT_BYTES) -> None:
        self._max_event = max_event
        self._pending = bytearray()
        self._scanned = 0  # bytes of _pending already searched for an event end

    def feed(self, piece: bytes) -> Iterator[bytes]:
        self._pending += piece
        while True:
            end, size = self._event_end()
            if end < 0:
                if len(self._pending) > self._max_event:
                    raise UpstreamError(
                        f"upstream stream broke the contract: an event over {self._max_event} bytes"
                    )
                self._scanned = max(0, len(self._pending) - 3)
                return
            if end + size == len(self._pending):
                # The event ends the buffer (a large final chunk usually does): hand the
                # buffer itself over instead of copying it out.
                del self._pending[end:]
                event: bytes | bytearray = self._pending
                self._pending = bytearray()
            else:
                event = bytes(self._pending[:end])
                del self._pending[: end + size]
            self._scanned = 0
            data = _data_of(event)
            if data is not None:
                yield data

    def _event_end(self) -> tuple[int, int]:
        """(start, length) of the first blank line, or (-1, 0). Steps from one `\n` to the
        next: a one-byte find is a memchr, several times faster over MiBs of base64 than
        searching for `\n\n` and `\r\n\r\n` (measured 33-50 ms vs ~5 ms per 24 MiB)."""
        pending = self._pending
        at = self._scanned
        while (at := pending.find(b"\n", at)) >= 0:
            if pending[at + 1 : at + 2] == b"\n":
                return at, 2
            if pending[at + 1 : at + 3] == b"\r\n" and pending[at - 1 : at] == b"\r":
                return at - 1, 4
            if at + 3 > len(pending):
                break  # the end may still be arriving: look here again with more bytes
            at += 1
        return -1, 0

    @property
    def leftover(self) -> bytes:
        return bytes(self._pending)


def _data_of(event: bytes | bytearray) -> bytes | None:
    if event.startswith(b"data:") and b"\n" not in event:
        # One `data:` line, the usual event: one copy, however large the payload.
        start = 6 if event[5:6] == b" " else 5
        stop = len(event) - 1 if event.endswith(b"\r") else len(event)
        return bytes(memoryview(event)[start:stop])
    lines = [line.rstrip(b"\r") for line in bytes(event).split(b"\n")]
    data = [line[5:].removeprefix(b" ") for line in lines if line.startswith(b"data:")]
    return b"\n".join(data) if data else None


@dataclass
class MessageAssembler:
    """The assistant message of a streamed turn, from the chunks' deltas."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)

    def add(self, delta: Any) -> None:
        if not isinstance(delta, dict):
            return
        text = delta.get("content")
        if isinstance(text, str):
            self.content.append(text)
        thought = delta.get("reasoning_content")
        if isinstance(thought, str):
            self.reasoning.append(thought)
        for call in delta.get("tool_calls") or []:
            if isinstance(call, dict):
                self._add_call(call)

    def _add_call(self, call: dict[str, Any]) -> None:
        # OpenAI streams a call in fragments sharing an index; the first carries id and name.
        index = call.get("index", len(self.tool_calls))
        index = index if isinstance(index, int) else len(self.tool_calls)
        merged = self.tool_calls.setdefault(
            index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
        )
        if call.get("id"):
            merged["id"] = call["id"]
        if call.get("type"):
            merged["type"] = call["type"]
        function = call.get("function")
        if isinstance(function, dict):
            if isinstance(function.get("name"), str):
                merged["function"]["name"] += function["name"]
            if isinstance(function.get("arguments"), str):
                merged["function"]["arguments"] += function["arguments"]

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.content)}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        return message


def _broken(detail: str) -> UpstreamError:
    return UpstreamError(f"upstream stream broke the contract: {detail}")


def _r3_span(data: bytes) -> tuple[int, int] | None:
    """(start, end) of the base64 text of a top-level-looking `"routed_experts": "..."`
    member in an event, or None. Base64 has no quote or backslash, so the text ends at the
    next quote."""
    at = data.find(_R3_KEY)
    if at < 0:
        return None
    at += len(_R3_KEY)
    while at < len(data) and data[at] in b" \t\r\n":
        at += 1
    if data[at : at + 1] != b":":
        return None
    at += 1
    while at < len(data) and data[at] in b" \t\r\n":
        at += 1
    if data[at : at + 1] != b'"':
        return None
    end = data.find(b'"', at + 1)
    return None if end < 0 else (at + 1, end)


@dataclass
class StreamedTurn:
    """Accumulates one relayed SGLang stream; `feed` says what the client gets of each event,
    `reply` rebuilds the non-stream reply the record keeps."""

    client_wants_usage: bool = False
    assembler: MessageAssembler = field(default_factory=MessageAssembler)
    logprobs: list[float] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)
    output_ids: list[int] | None = None
    cached_details: dict[str, Any] | None = None  # sglext.cached_tokens_details
    routed_experts: memoryview | None = None
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    matched_stop: Any = None
    head: dict[str, Any] = field(default_factory=dict)
    done: bool = False
    # The last event `feed` parsed (a dialect's relay converts it without parsing it again).
    event: dict[str, Any] = field(default_factory=dict)

    def feed(self, data: bytes) -> bytes | None:
        """One event's data: what to relay to the client (None: nothing)."""
        if data == DONE:
            self.done = True
            return None
        r3: memoryview | None = None
        if len(data) >= _LARGE_EVENT and (span := _r3_span(data)) is not None:
            # Parse the event without its R3 text (one small copy); keep the text as a view.
            start, end = span
            r3 = memoryview(data)[start:end]
            data = data[: start - 1] + b"null" + data[end + 1 :]
        try:
            event = json.loads(data)
        except ValueError:
            raise _broken(f"an event is not JSON: {bytes(data[:120])!r}") from None
        if not isinstance(event, dict):
            raise _broken(f"an event is not a JSON object: {bytes(data[:120])!r}")
        self.event = event
        if "error" in event or event.get("object") == "error":
            error = event.get("error", event)
            message = error.get("message") if isinstance(error, dict) else error
            raise UpstreamError(f"upstream stream failed: {message}")
        for key in ("id", "created", "model"):
            if key in event and key not in self.head:
                self.head[key] = event[key]
        sglext = event.get("sglext")
        if isinstance(sglext, dict):
            self._take_sglext(sglext, r3)
        usage = event.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        choices = event.get("choices")
        if not isinstance(choices, list):
            raise _broken(f"an event has no choices list: {bytes(data[:120])!r}")
        if not choices:
            # sglext and usage chunks: R3 and ids are the record's; usage only if asked.
            return (
                data if usage is not None and sglext is None and self.client_wants_usage else None
            )
        self._take_choice(choices[0])
        return data

    def _take_sglext(self, sglext: dict[str, Any], r3: memoryview | None) -> None:
        ids = sglext.get("output_ids")
        if ids is not None:
            # One list per choice (n > 1 is not a session turn): the first.
            if not isinstance(ids, list) or not ids or not isinstance(ids[0], list):
                raise _broken("sglext.output_ids is not a list of id lists")
            self.output_ids = ids[0]
        details = sglext.get("cached_tokens_details")
        if isinstance(details, dict):
            self.cached_details = details
        if r3 is not None:
            self.routed_experts = r3
        elif isinstance(sglext.get("routed_experts"), str):
            self.routed_experts = memoryview(sglext["routed_experts"].encode())

    def _take_choice(self, choice: Any) -> None:
        if not isinstance(choice, dict):
            raise _broken("choices[0] is not an object")
        self.assembler.add(choice.get("delta"))
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict):
            for entry in logprobs.get("content") or []:
                if not isinstance(entry, dict) or not isinstance(entry.get("logprob"), int | float):
                    raise _broken(f"a logprobs.content entry has no logprob: {entry!r:.80}")
                self.logprobs.append(float(entry["logprob"]))
                token = entry.get("token")
                self.token_texts.append(token if isinstance(token, str) else "")
        if choice.get("finish_reason") is not None:
            self.finish_reason = str(choice["finish_reason"])
            self.matched_stop = choice.get("matched_stop")

    def reply(self) -> bytes:
        """The turn as a non-stream reply (`chat.completion` with `meta_info`), R3 spliced
        in as bytes; `extract_reply` checks it like any reply."""
        if not self.done:
            raise _broken("it ended without data: [DONE]")
        if self.finish_reason is None:
            raise _broken("no chunk carried a finish_reason")
        if self.output_ids is None:
            raise _broken(
                "no sglext.output_ids (the engine must support return_output_ids_in_sglext, "
                "SGLang >= 0.5.23; or serve with --stream-upstream buffered)"
            )
        ids = self.output_ids
        if len(ids) != len(self.logprobs):
            raise _broken(
                f"sglext.output_ids has {len(ids)} ids but the chunks carried "
                f"{len(self.logprobs)} logprobs"
            )
        usage = self.usage or {}
        completion_tokens = usage.get("completion_tokens", len(ids))
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if cached is None:
            cached = _cached_from_details(self.cached_details)
        # SGLang's meta_info says "stop" where the OpenAI finish reason says "tool_calls".
        kind = "stop" if self.finish_reason == "tool_calls" else self.finish_reason
        meta: dict[str, Any] = {
            "id": self.head.get("id"),
            "finish_reason": {"type": kind, "matched": self.matched_stop},
            "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": completion_tokens,
            "cached_tokens": cached,
            "output_token_logprobs": [
                [lp, token_id, text]
                for lp, token_id, text in zip(self.logprobs, ids, self.token_texts, strict=True)
            ],
            "output_token_logprobs_length": len(ids),
        }
        if self.routed_experts is not None:
            meta["routed_experts"] = _R3_PLACEHOLDER
        document = {
            **self.head,
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": self.assembler.message(),
                    "logprobs": None,
                    "finish_reason": self.finish_reason,
                    "matched_stop": self.matched_stop,
                    "meta_info": meta,
                }
            ],
            "usage": self.usage,
        }
        body = json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode()
        if self.routed_experts is None:
            return body
        at = body.find(_R3_MEMBER)
        value = at + len(b'"routed_experts":"')
        return b"".join([body[:value], self.routed_experts, body[value + len(_R3_PLACEHOLDER) :]])


def _cached_from_details(details: dict[str, Any] | None) -> int:
    """Cached prompt tokens from sglext.cached_tokens_details (asked with
    return_cached_tokens_details): device + host + storage; SGLang sends none when nothing
    was cached (scheduler_components/output_streamer.py)."""
    if details is None:
        return 0
    parts = (details.get(k) for k in ("device", "host", "storage"))
    return sum(p for p in parts if isinstance(p, int) and not isinstance(p, bool))


def sse(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


def error_event(message: str) -> bytes:
    """What a client gets when a stream fails after its 200 status line went out."""
    return sse(json.dumps({"error": message}).encode())


class ClosingStream:
    """An async iterator over `chunks` whose `aclose()` always runs `cleanup` (once), even
    when nobody ever iterated: an async generator's `finally` does not run if it was never
    started, and a reply stream can be dropped before its first chunk (the client or the
    router went away while the status line was being sent)."""

    def __init__(
        self, chunks: AsyncIterator[bytes], cleanup: Callable[[], Awaitable[None]]
    ) -> None:
        self._chunks = chunks
        self._cleanup = cleanup
        self._closed = False

    def __aiter__(self) -> ClosingStream:
        return self

    async def __anext__(self) -> bytes:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await close_stream(self._chunks)
        finally:
            await self._cleanup()

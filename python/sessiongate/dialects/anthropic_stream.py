"""An Anthropic Messages stream made incrementally from the engine's chat stream, for a session
turn relayed under `--stream-upstream relay` (docs/api.md, "Anthropic Messages sessions").

Why its own module: the buffered path (`message_stream_events`) shapes a whole reply at once,
but a relayed turn must send each event as its chat chunk arrives, so the conversion has to
keep state across chunks (which block is open, its index, whether `message_start` went out).
This restates SGLang 0.5.23's `_generate_anthropic_stream` (anthropic/serving.py) chunk by
chunk: `message_start` before the first chunk with a payload or a finish reason, a block
opened per kind (a new `tool_use` block per named call), one delta event per chunk delta,
and at the end (after the turn is recorded) the open block's stop, `message_delta` (stop
reason, output usage) and `message_stop`. A failure after the status line went out is told
as SGLang tells it: the open block closed, an `error` event, `message_stop`.

The one difference from SGLang: `message_start`'s input usage. SGLang asks its chat stream for
`continuous_usage_stats`, so the first chunk carries the prompt count; the gateway asks for it
too and, when a chunk has none (an engine without continuous usage), counts the prompt ids it
sent itself, which is the engine's count when nothing was cached.
"""

from __future__ import annotations

import uuid
from typing import Any

from sessiongate.dialects.anthropic import STOP_REASON_MAP, _event, _usage


class MessageStreamRelay:
    """Chat chunks in, Anthropic SSE events out (`StreamRelay`, sessiongate.dialects)."""

    def __init__(
        self, request: dict[str, Any], prompt_tokens: int, *, message_id: str | None = None
    ) -> None:
        self._model = request.get("model")
        self._prompt_tokens = prompt_tokens
        self._message_id = message_id or f"msg_{uuid.uuid4().hex}"
        self._started = False
        self._index = 0
        self._open: str | None = None  # the open block's type
        self._finish_reason: str | None = None

    def _start(self, usage: object) -> list[bytes]:
        """`message_start`, once (`_ensure_message_started`)."""
        if self._started:
            return []
        self._started = True
        if not isinstance(usage, dict) or usage.get("prompt_tokens") is None:
            usage = {"prompt_tokens": self._prompt_tokens}
        message: dict[str, Any] = {
            "id": self._message_id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self._model,
            "usage": _usage(usage, include_input=True, zero_output=True),
        }
        return [_event("message_start", {"message": message})]

    def _close(self) -> list[bytes]:
        """`_close_content_block_events` (no signature: the engine has none)."""
        if self._open is None:
            return []
        events = [_event("content_block_stop", {"index": self._index})]
        self._open = None
        self._index += 1
        return events

    def _ensure(self, kind: str, block: dict[str, Any], *, force_new: bool = False) -> list[bytes]:
        """`_ensure_content_block_events`: open a block of `kind`, closing another first."""
        events: list[bytes] = []
        if self._open is not None and (force_new or self._open != kind):
            events.extend(self._close())
        if self._open is None:
            events.append(
                _event("content_block_start", {"index": self._index, "content_block": block})
            )
            self._open = kind
        return events

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"index": self._index, "delta": delta})

    def chunk(self, event: dict[str, Any]) -> list[bytes]:
        """The events for one chat chunk (the loop body of `_generate_anthropic_stream`)."""
        choices = event.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return []
        choice = choices[0]
        usage = event.get("usage")
        if choice.get("finish_reason") is not None:
            self._finish_reason = str(choice["finish_reason"])
        delta = choice.get("delta")
        delta = delta if isinstance(delta, dict) else {}
        content = delta.get("content")
        has_text = isinstance(content, str) and content != ""
        has_payload = bool(delta.get("reasoning_content") or delta.get("tool_calls") or has_text)
        has_payload = has_payload or bool(usage)
        events: list[bytes] = []
        if has_payload or choice.get("finish_reason") is not None:
            events.extend(self._start(usage))
        if not has_payload and delta.get("role") == "assistant" and not has_text:
            return events
        if delta.get("reasoning_content"):
            events.extend(self._ensure("thinking", {"type": "thinking", "thinking": ""}))
            thinking = {"type": "thinking_delta", "thinking": delta["reasoning_content"]}
            events.append(self._delta(thinking))
        for call in delta.get("tool_calls") or []:
            events.extend(self._tool_call(call))
        if has_text:
            events.extend(self._ensure("text", {"type": "text", "text": ""}))
            events.append(self._delta({"type": "text_delta", "text": content}))
        return events

    def _tool_call(self, call: object) -> list[bytes]:
        """A named call opens a new `tool_use` block; an unnamed one continues the open one."""
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            return []
        function = call["function"]
        arguments = function.get("arguments")
        events: list[bytes] = []
        if function.get("name"):
            block = {
                "type": "tool_use",
                "id": call.get("id") or f"toolu_{uuid.uuid4().hex}",
                "name": function["name"],
                "input": {},
            }
            events.extend(self._ensure("tool_use", block, force_new=True))
        elif not arguments or self._open != "tool_use":
            return []  # SGLang drops argument deltas with no open tool_use block
        if arguments:
            events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return events

    def finish(self, chat_reply: dict[str, Any]) -> list[bytes]:
        """The events at the engine's `[DONE]`, once the turn is recorded."""
        usage = chat_reply.get("usage")
        events = self._start(None)
        events.extend(self._close())
        stop_reason = STOP_REASON_MAP.get(self._finish_reason or "stop", "end_turn")
        end_usage = (
            _usage(usage, include_input=False) if isinstance(usage, dict) else {"output_tokens": 0}
        )
        delta = {"delta": {"stop_reason": stop_reason}, "usage": end_usage}
        events.append(_event("message_delta", delta))
        events.append(_event("message_stop", {}))
        return events

    def fail(self, message: str) -> list[bytes]:
        """`_flush_on_error`: a well-formed end for a stream that failed after its 200."""
        events = self._start(None)
        events.extend(self._close())
        error = {"error": {"type": "api_error", "message": message}}
        events.append(_event("error", error))
        events.append(_event("message_stop", {}))
        return events

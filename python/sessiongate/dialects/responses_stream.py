"""An OpenAI Responses stream made incrementally from the engine's chat stream, for a session
turn relayed under `--stream-upstream relay` (docs/api.md, "OpenAI Responses sessions").

Why its own module: the buffered path (`response_stream_events`) shapes a whole reply at once,
but a relayed turn must send each event as its chat chunk arrives, so the conversion keeps
state across chunks (the open reasoning item, message, tool calls, their output indexes).
It restates SGLang 0.5.23's `_responses_stream_generator_non_harmony` over the chat chunks
(whose reasoning, text and calls the engine's parsers already separated): `response.created`
and `response.in_progress` at the first chunk (the response id is `resp_` + the chunk id, as
the record's reply id), a reasoning item opened by reasoning text, a message by text, a
function call by a named call (each closing what was open before), deltas as they come, and
at the end (after the turn is recorded) the open items' `done` events and
`response.completed` / `.incomplete` / `.failed` with the whole response. As
`responses_stream_generator_non_harmony`, when the request can call tools a message's
events are held back until a call follows (phase `commentary`) or the stream ends
(`final_answer`). A custom tool's input is sent as one delta when its call closes (the shim's
arguments are JSON around it). A failure after the status line went out is a
`response.failed` event; the turn is not recorded.
"""

from __future__ import annotations

import json
import time
from typing import Any

from sessiongate.dialects.responses import (
    _error_from_finish_reason,
    _hex,
    _output_text,
    _reply_parts,
    _usage,
    custom_tool_call_item,
    custom_tool_names,
    effective_tool_choice,
    function_call_item,
    message_item,
    reasoning_item,
    response_object,
    status_from_finish_reason,
)

_TERMINAL = ("response.completed", "response.incomplete", "response.failed")


class ResponseStreamRelay:
    """Chat chunks in, Responses SSE events out (`StreamRelay`, sessiongate.dialects)."""

    def __init__(self, request: dict[str, Any]) -> None:
        self._request = request
        reasoning = request.get("reasoning")
        self._summary = isinstance(reasoning, dict) and reasoning.get("summary") is not None
        self._custom = custom_tool_names(request)
        self._hold = bool(request.get("tools")) and effective_tool_choice(request) != "none"
        self._sequence = 0
        self._pending: list[dict[str, Any]] = []
        self._started = False
        self._response_id = ""
        self._created = int(time.time())
        self._model = request.get("model")
        self._items: list[dict[str, Any]] = []  # closed items, in output order
        self._index = -1
        self._reasoning: dict[str, Any] | None = None  # the open one: id, index, text
        self._message: dict[str, Any] | None = None
        self._calls: list[dict[str, Any]] = []  # open calls: call, id, index, arguments

    # -- sending ----------------------------------------------------------------------------

    def _send(self, event_type: str, **fields: Any) -> list[bytes]:
        payload = {**fields, "sequence_number": self._sequence, "type": event_type}
        self._sequence += 1
        item_type = (payload.get("item") or {}).get("type")
        opens = event_type == "response.output_item.added"
        if not self._hold or not (self._pending or (opens and item_type == "message")):
            return [_frame(payload)]
        self._pending.append(payload)
        terminal = event_type in _TERMINAL
        follows = opens and item_type in ("function_call", "custom_tool_call")
        if not (follows or terminal):
            return []
        phase = "commentary" if follows else "final_answer"
        out = []
        for held in self._pending:
            if (held.get("item") or {}).get("type") == "message":
                held["item"]["phase"] = phase
            out.append(_frame(held))
        self._pending.clear()
        return out

    def _start(self, event: dict[str, Any]) -> list[bytes]:
        if self._started:
            return []
        self._started = True
        chunk_id = event.get("id")
        self._response_id = f"resp_{chunk_id}" if isinstance(chunk_id, str) and chunk_id else ""
        self._response_id = self._response_id or f"resp_{_hex()}"
        if isinstance(event.get("created"), int):
            self._created = event["created"]
        self._model = self._model or event.get("model")
        initial = self._response([], "in_progress", None)
        return self._send("response.created", response=initial) + self._send(
            "response.in_progress", response=initial
        )

    def _response(
        self, output: list[dict[str, Any]], status: str, usage: dict[str, Any] | None
    ) -> dict[str, Any]:
        return response_object(
            self._request,
            response_id=self._response_id,
            created_at=self._created,
            model=self._model,
            output=output,
            status=status,
            usage=usage,
        )

    # -- items ------------------------------------------------------------------------------

    def _open_reasoning(self) -> list[bytes]:
        self._index += 1
        item_id = f"rs_{_hex()}"
        state: dict[str, Any] = {"id": item_id, "index": self._index, "text": ""}
        self._reasoning = state
        added = reasoning_item(self._request, "", item_id, "in_progress")
        added.update(summary=[], content=[], encrypted_content=None)
        at = {"item_id": state["id"], "output_index": state["index"]}
        events = self._send("response.output_item.added", item=added, output_index=self._index)
        if self._summary:
            part = {"text": "", "type": "summary_text"}
            events += self._send(
                "response.reasoning_summary_part.added", **at, part=part, summary_index=0
            )
        else:
            part = {"text": "", "type": "reasoning_text"}
            events += self._send("response.content_part.added", content_index=0, **at, part=part)
        return events

    def _reasoning_delta(self, text: str) -> list[bytes]:
        events = self._close_message()
        if self._reasoning is None:
            events += self._open_reasoning()
        state = self._reasoning
        assert state is not None
        state["text"] += text
        at = {"item_id": state["id"], "output_index": state["index"]}
        if self._summary:
            kind = "response.reasoning_summary_text.delta"
            return events + self._send(kind, delta=text, **at, summary_index=0)
        kind = "response.reasoning_text.delta"
        return events + self._send(kind, content_index=0, delta=text, **at)

    def _close_reasoning(self) -> list[bytes]:
        state, self._reasoning = self._reasoning, None
        if state is None:
            return []
        text = state["text"]
        at = {"item_id": state["id"], "output_index": state["index"]}
        if self._summary:
            events = self._send(
                "response.reasoning_summary_text.done", **at, summary_index=0, text=text
            )
            part = {"text": text, "type": "summary_text"}
            events += self._send(
                "response.reasoning_summary_part.done", **at, part=part, summary_index=0
            )
        else:
            events = self._send("response.reasoning_text.done", content_index=0, **at, text=text)
            part = {"text": text, "type": "reasoning_text"}
            events += self._send("response.content_part.done", content_index=0, **at, part=part)
        item = reasoning_item(self._request, text, state["id"], "completed")
        self._items.append(item)
        return events + self._send(
            "response.output_item.done", item=item, output_index=at["output_index"]
        )

    def _text_delta(self, text: str) -> list[bytes]:
        if self._calls and not text.strip():
            return []  # `_should_emit_normal_text_as_message`: a separator between calls
        events = self._close_reasoning() + self._close_calls()
        if self._message is None:
            self._index += 1
            self._message = {"id": f"msg_{_hex()}", "index": self._index, "text": ""}
            added = message_item(self._message["id"], "", "in_progress", "final_answer")
            events += self._send("response.output_item.added", item=added, output_index=self._index)
            at = {"item_id": self._message["id"], "output_index": self._index}
            events += self._send(
                "response.content_part.added", content_index=0, **at, part=_output_text("")
            )
        state = self._message
        state["text"] += text
        at = {"item_id": state["id"], "output_index": state["index"]}
        return events + self._send(
            "response.output_text.delta", content_index=0, delta=text, **at, logprobs=[]
        )

    def _close_message(self) -> list[bytes]:
        state, self._message = self._message, None
        if state is None:
            return []
        text = state["text"]
        at = {"item_id": state["id"], "output_index": state["index"]}
        events = self._send(
            "response.output_text.done", content_index=0, **at, logprobs=[], text=text
        )
        part = _output_text(text)
        events += self._send("response.content_part.done", content_index=0, **at, part=part)
        item = message_item(state["id"], text, "completed", "final_answer")
        self._items.append(item)
        return events + self._send(
            "response.output_item.done", item=item, output_index=at["output_index"]
        )

    def _open_call(self, call: dict[str, Any]) -> list[bytes]:
        events = self._close_reasoning() + self._close_message() + self._close_calls()
        for item in self._items:
            if item["type"] == "message":
                item["phase"] = "commentary"
        name = (call.get("function") or {}).get("name") or ""
        custom = name in self._custom
        self._index += 1
        item_id = f"ctc_{_hex()[:8]}" if custom else f"fc_{_hex()[:8]}"
        state = {"call": call, "id": item_id, "index": self._index, "arguments": ""}
        state["custom"] = custom
        self._calls.append(state)
        if custom:
            added = custom_tool_call_item(call, item_id, payload="")
        else:
            added = function_call_item(call, item_id, arguments="", status="in_progress")
        state["call_id"] = added["call_id"]
        return events + self._send(
            "response.output_item.added", item=added, output_index=self._index
        )

    def _arguments(self, text: str) -> list[bytes]:
        if not self._calls or not text:
            return []
        state = self._calls[-1]
        state["arguments"] += text
        if state["custom"]:
            return []  # the payload goes out decoded when the call closes
        at = {"item_id": state["id"], "output_index": state["index"]}
        return self._send("response.function_call_arguments.delta", delta=text, **at)

    def _close_calls(self) -> list[bytes]:
        events: list[bytes] = []
        for state in self._calls:
            call = {**state["call"], "id": state["call_id"]}
            call["function"] = {**(call.get("function") or {}), "arguments": state["arguments"]}
            at = {"item_id": state["id"], "output_index": state["index"]}
            if state["custom"]:
                item = custom_tool_call_item(call, state["id"])
                if item["input"]:
                    events += self._send(
                        "response.custom_tool_call_input.delta", delta=item["input"], **at
                    )
                events += self._send(
                    "response.custom_tool_call_input.done", input=item["input"], **at
                )
            else:
                item = function_call_item(call, state["id"], status="completed")
                events += self._send(
                    "response.function_call_arguments.done",
                    arguments=item["arguments"],
                    **at,
                    name=item["name"],
                )
            self._items.append(item)
            events += self._send(
                "response.output_item.done", item=item, output_index=state["index"]
            )
        self._calls = []
        return events

    # -- StreamRelay ------------------------------------------------------------------------

    def chunk(self, event: dict[str, Any]) -> list[bytes]:
        """The events for one chat chunk: reasoning, continued arguments, text, new calls
        (the order `_responses_stream_generator_non_harmony` restores within one step)."""
        events = self._start(event)
        choices = event.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return events
        delta = choices[0].get("delta")
        if not isinstance(delta, dict):
            return events
        if isinstance(delta.get("reasoning_content"), str) and delta["reasoning_content"]:
            events += self._reasoning_delta(delta["reasoning_content"])
        calls = [c for c in delta.get("tool_calls") or [] if isinstance(c, dict)]
        opening = [c for c in calls if (c.get("function") or {}).get("name")]
        for call in calls:
            if call not in opening:
                events += self._arguments((call.get("function") or {}).get("arguments") or "")
        if isinstance(delta.get("content"), str) and delta["content"]:
            events += self._text_delta(delta["content"])
        for call in opening:
            events += self._open_call(call)
            events += self._arguments(call["function"].get("arguments") or "")
        return events

    def finish(self, chat_reply: dict[str, Any]) -> list[bytes]:
        """The open items' closing events and the final `response.<status>`."""
        events = self._start(chat_reply)
        events += self._close_reasoning() + self._close_message() + self._close_calls()
        _, _, _, finish = _reply_parts(chat_reply)
        status = status_from_finish_reason(finish)
        final = self._response(list(self._items), status, _usage(chat_reply))
        final["error"] = _error_from_finish_reason(finish)
        return events + self._send(f"response.{status}", response=final)

    def fail(self, message: str) -> list[bytes]:
        """`response.failed` (SGLang's stream error: no output, the message as `error`)."""
        events = self._start({})
        failed = self._response([], "failed", None)
        failed["error"] = {"code": "server_error", "message": message}
        return events + self._send("response.failed", response=failed)


def _frame(payload: dict[str, Any]) -> bytes:
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"event: {payload['type']}\ndata: {data}\n\n".encode()

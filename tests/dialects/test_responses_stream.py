"""`ResponseStreamRelay` (dialects/responses_stream.py) in process: chat chunks split any way
convert to the events `response_stream_events` makes from the whole reply (deltas merged,
ids and sequence numbers aside; a message held back until its phase is known), and a failed
stream ends with `response.failed`."""

from __future__ import annotations

import json
from typing import Any

from sessiongate.dialects.responses import response_stream_events
from sessiongate.dialects.responses_stream import ResponseStreamRelay

TOOLS = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
REQUEST: dict[str, Any] = {"model": "m", "input": "hi", "tools": TOOLS}
USAGE = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
IDS = ("id", "item_id", "created_at", "sequence_number")


def _scrub(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _scrub(v) for k, v in value.items() if k not in IDS}
    if isinstance(value, list):
        return [_scrub(v) for v in value]
    return value


def _parsed(events: list[bytes]) -> list[dict[str, Any]]:
    """Each event's data without ids, adjacent deltas of one kind merged."""
    out: list[dict[str, Any]] = []
    for raw in events:
        data = _scrub(json.loads(raw.split(b"data: ", 1)[1]))
        if out and data["type"].endswith(".delta") and out[-1]["type"] == data["type"]:
            out[-1]["delta"] += data["delta"]
            continue
        out.append(data)
    return out


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "c", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def _reply(message: dict[str, Any], finish: str) -> dict[str, Any]:
    return {"id": "c", "choices": [{"message": message, "finish_reason": finish}], "usage": USAGE}


def _relayed(
    request: dict[str, Any], chunks: list[dict[str, Any]], reply: dict[str, Any]
) -> list[bytes]:
    relay = ResponseStreamRelay(request)
    events = [event for chunk in chunks for event in relay.chunk(chunk)]
    return events + relay.finish(reply)


def test_split_chunks_equal_the_buffered_events() -> None:
    message = {"content": "Hello there", "reasoning_content": "hmm ok", "tool_calls": [CALL]}
    reply = _reply(message, "tool_calls")
    first = {"index": 0, "id": "call_1", "function": {"name": "f", "arguments": ""}}
    chunks = [
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"reasoning_content": "hmm"}),
        _chunk({"reasoning_content": " ok"}),
        _chunk({"content": "Hello"}),
        _chunk({"content": " there"}),
        _chunk({"tool_calls": [first]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),
        _chunk({}, finish="tool_calls"),
    ]
    buffered = response_stream_events(reply, REQUEST)
    assert _parsed(_relayed(REQUEST, chunks, reply)) == _parsed(buffered)


def test_a_final_answer_with_a_summary_and_a_length_stop() -> None:
    request = {**REQUEST, "reasoning": {"summary": "auto"}}
    reply = _reply({"content": "Hi", "reasoning_content": "r"}, "length")
    chunks = [
        _chunk({"reasoning_content": "r"}),
        _chunk({"content": "H"}),
        _chunk({"content": "i"}, finish="length"),
    ]
    buffered = response_stream_events(reply, request)
    assert _parsed(_relayed(request, chunks, reply)) == _parsed(buffered)


def test_a_failure_is_response_failed() -> None:
    relay = ResponseStreamRelay(REQUEST)
    relay.chunk(_chunk({"reasoning_content": "r"}))
    last = json.loads(relay.fail("cut")[-1].split(b"data: ", 1)[1])
    assert last["type"] == "response.failed"
    assert last["response"]["error"] == {"code": "server_error", "message": "cut"}

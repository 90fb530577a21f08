"""`MessageStreamRelay` (dialects/anthropic_stream.py) in process: chat chunks split any way
convert to the events `message_stream_events` makes from the whole reply (deltas merged), and
a failed stream still ends well-formed, as SGLang's `_flush_on_error` ends it."""

from __future__ import annotations

import json
from typing import Any

from sessiongate.dialects.anthropic import message_stream_events
from sessiongate.dialects.anthropic_stream import MessageStreamRelay

REQUEST = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
USAGE = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}


def _parsed(events: list[bytes]) -> list[dict[str, Any]]:
    """Each event's data, with adjacent deltas of one block merged and ids dropped."""
    out: list[dict[str, Any]] = []
    for raw in events:
        data = json.loads(raw.split(b"data: ", 1)[1])
        data.get("message", {}).pop("id", None)
        last = out[-1] if out else {}
        if data["type"] == last.get("type") == "content_block_delta":
            for key, value in data["delta"].items():
                if key != "type":
                    last["delta"][key] += value
            continue
        out.append(data)
    return out


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "c", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def _relayed(chunks: list[dict[str, Any]]) -> list[bytes]:
    relay = MessageStreamRelay(REQUEST, 7)
    events = [event for chunk in chunks for event in relay.chunk(chunk)]
    return events + relay.finish({"usage": USAGE})


def test_split_chunks_equal_the_buffered_events() -> None:
    reply = {
        "choices": [
            {
                "message": {
                    "content": "Hello there",
                    "reasoning_content": "hmm ok",
                    "tool_calls": [CALL],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": USAGE,
    }
    chunks = [
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"reasoning_content": "hmm"}),
        _chunk({"reasoning_content": " ok"}),
        _chunk({"content": "Hello"}),
        _chunk({"content": " there"}),
        _chunk(
            {
                "tool_calls": [
                    {"index": 0, "id": "call_1", "function": {"name": "f", "arguments": ""}}
                ]
            }
        ),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),
        _chunk({}, finish="tool_calls"),
    ]
    assert _parsed(_relayed(chunks)) == _parsed(message_stream_events(reply, REQUEST))


def test_an_empty_reply_still_starts_and_stops() -> None:
    reply = {"choices": [{"message": {"content": ""}, "finish_reason": "length"}], "usage": USAGE}
    chunks = [_chunk({"role": "assistant", "content": ""}), _chunk({}, finish="length")]
    assert _parsed(_relayed(chunks)) == _parsed(message_stream_events(reply, REQUEST))


def test_a_failure_closes_the_open_block() -> None:
    relay = MessageStreamRelay(REQUEST, 7)
    relay.chunk(_chunk({"content": "partial"}))
    kinds = [json.loads(e.split(b"data: ", 1)[1])["type"] for e in relay.fail("cut")]
    assert kinds == ["content_block_stop", "error", "message_stop"]
    start = MessageStreamRelay(REQUEST, 7).fail("cut")
    assert [json.loads(e.split(b"data: ", 1)[1])["type"] for e in start] == [
        "message_start",
        "error",
        "message_stop",
    ]

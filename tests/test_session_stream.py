"""The pieces of a streamed turn (session/stream.py): SSE splitting, message assembly, and
rebuilding the non-stream reply from the final chunk."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
from collections.abc import AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessiongate.session.errors import UpstreamError
from sessiongate.session.reply import parse_reply
from sessiongate.session.stream import (
    ClosingStream,
    MessageAssembler,
    SseEvents,
    final_event_for_client,
    message_bytes,
    reply_from_final_chunk,
)

payloads = st.lists(
    st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"").replace(b"\r", b"")),
    min_size=1,
    max_size=8,
)


@settings(max_examples=300, deadline=None)
@given(events=payloads, cuts=st.lists(st.integers(0, 400), max_size=10), crlf=st.booleans())
def test_events_survive_any_split_of_the_byte_stream(
    events: list[bytes], cuts: list[int], crlf: bool
) -> None:
    end = b"\r\n" if crlf else b"\n"
    wire = b"".join(b": comment" + end + b"data: " + e + end + end for e in events)
    splitter = SseEvents()
    got: list[bytes] = []
    start = 0
    for cut in [*sorted({min(c, len(wire)) for c in cuts}), len(wire)]:
        got.extend(splitter.feed(wire[start:cut]))
        start = cut
    assert got == events
    assert splitter.leftover == b""


def test_multi_line_data_and_other_fields() -> None:
    splitter = SseEvents()
    assert list(splitter.feed(b"event: x\nid: 3\ndata: a\ndata:b\n\n")) == [b"a\nb"]
    assert list(splitter.feed(b"retry: 5\n\n")) == []  # an event without data


def test_tool_call_fragments_are_merged_by_index() -> None:
    assembler = MessageAssembler()
    assembler.add({"role": "assistant", "content": ""})
    assembler.add({"content": "Let me look."})
    assembler.add(
        {
            "tool_calls": [
                {"index": 0, "id": "call_1", "function": {"name": "look", "arguments": ""}}
            ]
        }
    )
    assembler.add({"tool_calls": [{"index": 0, "function": {"arguments": '{"q":'}}]})
    assembler.add({"tool_calls": [{"index": 0, "function": {"arguments": '"x"}'}}]})
    assembler.add(None)
    assert assembler.message() == {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "look", "arguments": '{"q":"x"}'},
            }
        ],
    }


def _final_chunk(meta: dict[str, object]) -> bytes:
    chunk = {
        "id": "c",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "meta_info": meta}],
        "usage": {"completion_tokens": 2},
    }
    return json.dumps(chunk, separators=(",", ":")).encode()


def test_reply_rebuilt_from_the_final_chunk_passes_the_reply_contract() -> None:
    meta = {
        "completion_tokens": 2,
        "output_token_logprobs": [[-0.5, 7, None], [-0.25, 9, None]],
        "routed_experts": "AAAAAAEAAAA=",
        "finish_reason": {"type": "stop", "matched": 9},
    }
    message = message_bytes({"role": "assistant", "content": 'a "delta":{} b'})
    reply = reply_from_final_chunk(_final_chunk(meta), message)
    document = json.loads(reply)
    assert document["object"] == "chat.completion"
    assert document["choices"][0]["message"]["content"] == 'a "delta":{} b'
    parsed = parse_reply(reply)
    assert parsed.completion_ids == [7, 9]
    final = json.loads(final_event_for_client(parsed.client_body))
    assert final["object"] == "chat.completion.chunk"
    assert final["choices"][0]["delta"] == {}
    assert "routed_experts" not in final["choices"][0]["meta_info"]


def test_final_chunk_without_empty_delta_breaks_the_contract() -> None:
    with pytest.raises(UpstreamError, match="no empty"):
        reply_from_final_chunk(b'{"choices":[{"delta":{"content":"x"}}]}', message_bytes({}))


def test_an_event_without_end_is_refused_past_the_limit() -> None:
    splitter = SseEvents(max_event=1000)
    assert list(splitter.feed(b"data: " + b"x" * 900)) == []
    with pytest.raises(UpstreamError, match="over 1000 bytes"):
        list(splitter.feed(b"x" * 200))


@settings(max_examples=200, deadline=None)
@given(
    content=st.text(max_size=60),
    cuts=st.lists(st.integers(0, 60), max_size=6),
    lps=st.lists(st.tuples(st.floats(-30, 0), st.integers(0, 150_000)), min_size=1, max_size=8),
    r3=st.one_of(st.none(), st.binary(max_size=64)),
    tool=st.booleans(),
    ascii_only=st.booleans(),
)
def test_rebuilt_reply_reads_like_the_non_stream_reply(
    content: str,
    cuts: list[int],
    lps: list[tuple[float, int]],
    r3: bytes | None,
    tool: bool,
    ascii_only: bool,
) -> None:
    message: dict[str, object] = {"role": "assistant", "content": content}
    if tool:
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        message["tool_calls"] = [call]
    meta: dict[str, object] = {
        "completion_tokens": len(lps),
        "output_token_logprobs": [[lp, token, None] for lp, token in lps],
        "finish_reason": {"type": "stop", "matched": lps[-1][1]},
    }
    if r3 is not None:
        meta["routed_experts"] = base64.b64encode(r3).decode()
    choice = {"index": 0, "message": message, "finish_reason": "stop", "meta_info": meta}
    whole = {"id": "x", "object": "chat.completion", "model": "m", "choices": [choice]}

    # The stream: content in pieces (a tool call whole, as the mock sends it), then the final
    # chunk with an empty delta and the complete meta_info.
    assembler = MessageAssembler()
    assembler.add({"role": "assistant", "content": ""})
    bounds = [0, *sorted(min(c, len(content)) for c in cuts), len(content)]
    for start, end in itertools.pairwise(bounds):
        assembler.add({"content": content[start:end]})
    if tool:
        assembler.add({"tool_calls": [{"index": 0, **message["tool_calls"][0]}]})  # type: ignore[index]
    final_choice = {k: v for k, v in choice.items() if k != "message"} | {"delta": {}}
    final = {**whole, "object": "chat.completion.chunk", "choices": [final_choice]}
    final_bytes = json.dumps(final, ensure_ascii=ascii_only, separators=(",", ":")).encode()

    rebuilt = parse_reply(reply_from_final_chunk(final_bytes, message_bytes(assembler.message())))
    expected = parse_reply(json.dumps(whole).encode())
    assert rebuilt.completion_ids == expected.completion_ids
    assert rebuilt.logprobs == expected.logprobs
    assert rebuilt.finish_reason == expected.finish_reason
    assert rebuilt.assistant_message == expected.assistant_message
    assert (rebuilt.routed_experts is None) == (r3 is None)
    if r3 is not None:
        assert base64.b64decode(bytes(rebuilt.routed_experts)) == r3  # type: ignore[arg-type]
    client_final = json.loads(final_event_for_client(rebuilt.client_body))
    assert client_final["choices"][0]["delta"] == {}
    assert "routed_experts" not in client_final["choices"][0]["meta_info"]


def test_closing_stream_cleans_up_once_even_if_never_iterated() -> None:
    calls: list[str] = []

    async def chunks() -> AsyncIterator[bytes]:
        try:
            yield b"a"
            yield b"b"
        finally:
            calls.append("generator finally")

    async def cleanup() -> None:
        calls.append("cleanup")

    async def main() -> None:
        never = ClosingStream(chunks(), cleanup)
        await never.aclose()
        await never.aclose()
        assert calls == ["cleanup"]  # the generator never started: only the cleanup runs
        calls.clear()
        whole = ClosingStream(chunks(), cleanup)
        assert [chunk async for chunk in whole] == [b"a", b"b"]
        await whole.aclose()
        assert calls == ["generator finally", "cleanup"]

    asyncio.run(main())

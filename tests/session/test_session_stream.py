"""The pieces of a relayed turn (session/stream.py): SSE splitting, message assembly, and
rebuilding the non-stream reply from the events SGLang 0.5.23 streams (serving_chat.py
`_generate_chat_stream`: no meta_info in any chunk, ids and R3 in a trailing `sglext` chunk,
counts in a `usage` chunk)."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import re
from collections.abc import AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessiongate.errors import UpstreamError
from sessiongate.session.reply import parse_reply
from sessiongate.session.stream import (
    DONE,
    ClosingStream,
    MessageAssembler,
    SseEvents,
    StreamedTurn,
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


def _dump(document: object, ascii_only: bool = False) -> bytes:
    return json.dumps(document, ensure_ascii=ascii_only, separators=(",", ":")).encode()


def _chunk(choices: list[dict[str, object]], **extra: object) -> dict[str, object]:
    head = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    return {**head, "choices": choices, **extra}


def sglang_events(
    pieces: list[tuple[str, list[tuple[float, int]]]],
    *,
    finish: str = "stop",
    r3: bytes | None = None,
    reasoning: str | None = None,
    ids: bool = True,
    ascii_only: bool = False,
) -> list[bytes]:
    """The data payloads SGLang streams for a turn whose content comes in `pieces`, each
    with its tokens' (logprob, id)."""
    events = [_dump(_chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}}]))]
    if reasoning is not None:
        delta = {"reasoning_content": reasoning}
        events.append(_dump(_chunk([{"index": 0, "delta": delta, "logprobs": None}])))
    for text, tokens in pieces:
        content = [
            {"token": f"t{token}", "logprob": lp, "bytes": [], "top_logprobs": []}
            for lp, token in tokens
        ]
        choice = {"index": 0, "delta": {"content": text}, "logprobs": {"content": content}}
        events.append(_dump(_chunk([choice]), ascii_only))
    done_choice = {
        "index": 0,
        "delta": {"reasoning_content": None},
        "finish_reason": finish,
        "matched_stop": 2,
    }
    events.append(_dump(_chunk([done_choice])))
    sglext: dict[str, object] = {}
    if ids:
        sglext["output_ids"] = [[token for _, tokens in pieces for _, token in tokens]]
    if r3 is not None:
        sglext["routed_experts"] = base64.b64encode(r3).decode()
    if sglext:
        events.append(_dump(_chunk([], sglext=sglext)))
    count = sum(len(tokens) for _, tokens in pieces)
    usage = {
        "prompt_tokens": 5,
        "completion_tokens": count,
        "total_tokens": 5 + count,
        "prompt_tokens_details": {"cached_tokens": 3},
    }
    events.append(_dump(_chunk([], usage=usage)))
    events.append(DONE)
    return events


def test_reply_rebuilt_from_an_sglang_stream_passes_the_reply_contract() -> None:
    events = sglang_events(
        [("a ", [(-0.5, 7)]), ('"delta":{} b', [(-0.25, 9)])], r3=b"\x01" * 8, reasoning="hm"
    )
    turn = StreamedTurn()
    relayed = [turn.feed(e) for e in events]
    # Content and finish chunks go out; sglext, an unasked-for usage and [DONE] do not.
    assert relayed[:-3] == events[:-3]
    assert relayed[-3:] == [None, None, None]
    reply = turn.reply()
    document = json.loads(reply)
    assert document["object"] == "chat.completion"
    meta = document["choices"][0]["meta_info"]
    assert meta["output_token_logprobs"] == [[-0.5, 7, "t7"], [-0.25, 9, "t9"]]
    assert meta["cached_tokens"] == 3 and meta["prompt_tokens"] == 5
    assert meta["finish_reason"] == {"type": "stop", "matched": 2}
    parsed = parse_reply(reply)
    assert parsed.completion_ids == [7, 9]
    assert parsed.cached_tokens == 3
    assert parsed.assistant_message == {
        "role": "assistant",
        "content": 'a "delta":{} b',
        "reasoning_content": "hm",
    }
    assert base64.b64decode(bytes(parsed.routed_experts)) == b"\x01" * 8  # type: ignore[arg-type]


def test_usage_is_relayed_when_the_client_asked() -> None:
    events = sglang_events([("a", [(-0.5, 7)])])
    turn = StreamedTurn(client_wants_usage=True)
    relayed = [turn.feed(e) for e in events]
    assert relayed[-2] == events[-2] and b'"usage"' in events[-2]


def test_a_large_r3_is_sliced_not_parsed() -> None:
    r3 = bytes(range(256)) * 1024  # 256 KiB raw: the byte-search path
    events = sglang_events([("x", [(-1.0, 4)])], r3=r3)
    turn = StreamedTurn()
    for event in events:
        turn.feed(event)
    assert turn.routed_experts is not None and len(turn.routed_experts) > 64 * 1024
    parsed = parse_reply(turn.reply())
    assert base64.b64decode(bytes(parsed.routed_experts)) == r3  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("events", "fragment"),
    [
        (sglang_events([("x", [(-1.0, 4)])])[:-1], "without data: [DONE]"),
        (sglang_events([("x", [(-1.0, 4)])], ids=False), "no sglext.output_ids"),
        (
            [e for e in sglang_events([("x", [(-1.0, 4)])]) if b'"finish_reason"' not in e],
            "no chunk carried a finish_reason",
        ),
    ],
)
def test_a_stream_that_breaks_the_contract(events: list[bytes], fragment: str) -> None:
    turn = StreamedTurn()
    for event in events:
        turn.feed(event)
    with pytest.raises(UpstreamError, match=re.escape(fragment)):
        turn.reply()


def test_ids_and_logprobs_must_agree() -> None:
    events = sglang_events([("x", [(-1.0, 4)])])
    events[-3] = _dump(_chunk([], sglext={"output_ids": [[4, 5]]}))
    turn = StreamedTurn()
    for event in events:
        turn.feed(event)
    with pytest.raises(UpstreamError, match="2 ids but the chunks carried 1 logprobs"):
        turn.reply()


def test_an_error_event_fails_the_turn() -> None:
    # serving_base.py create_streaming_error_response: {"error": {"object": "error", ...}}.
    error = {"error": {"object": "error", "message": "out of memory", "code": 500}}
    turn = StreamedTurn()
    turn.feed(sglang_events([("x", [(-1.0, 4)])])[0])
    with pytest.raises(UpstreamError, match="out of memory"):
        turn.feed(_dump(error))


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
    reasoning=st.one_of(st.none(), st.text(max_size=20)),
    finish=st.sampled_from(["stop", "length", "abort"]),
    ascii_only=st.booleans(),
)
def test_rebuilt_reply_reads_like_the_non_stream_reply(
    content: str,
    cuts: list[int],
    lps: list[tuple[float, int]],
    r3: bytes | None,
    reasoning: str | None,
    finish: str,
    ascii_only: bool,
) -> None:
    message: dict[str, object] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    meta: dict[str, object] = {
        "completion_tokens": len(lps),
        "output_token_logprobs": [[lp, token, f"t{token}"] for lp, token in lps],
        "finish_reason": {"type": finish, "matched": 2},
    }
    if r3 is not None:
        meta["routed_experts"] = base64.b64encode(r3).decode()
    choice = {"index": 0, "message": message, "finish_reason": finish, "meta_info": meta}
    whole = {"id": "c", "object": "chat.completion", "model": "m", "choices": [choice]}

    # The same turn streamed: content cut anywhere, tokens spread over the pieces.
    bounds = [0, *sorted(min(c, len(content)) for c in cuts), len(content)]
    texts = [content[start:end] for start, end in itertools.pairwise(bounds)]
    pieces = [(text, []) for text in texts]
    for index, token in enumerate(lps):
        pieces[index * len(pieces) // len(lps)][1].append(token)
    turn = StreamedTurn()
    events = sglang_events(pieces, finish=finish, r3=r3, reasoning=reasoning, ascii_only=ascii_only)
    for event in events:
        turn.feed(event)

    rebuilt = parse_reply(turn.reply())
    expected = parse_reply(json.dumps(whole).encode())
    assert rebuilt.completion_ids == expected.completion_ids
    assert rebuilt.logprobs == expected.logprobs
    assert rebuilt.finish_reason == expected.finish_reason
    assert rebuilt.assistant_message == expected.assistant_message
    assert (rebuilt.routed_experts is None) == (r3 is None)
    if r3 is not None:
        assert base64.b64decode(bytes(rebuilt.routed_experts)) == r3  # type: ignore[arg-type]
    # The key, not the bytes: hypothesis mines this file's literals into the content.
    client_meta = json.loads(rebuilt.client_body)["choices"][0].get("meta_info", {})
    assert "routed_experts" not in client_meta


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

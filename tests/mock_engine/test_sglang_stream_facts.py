"""The mock engine's chat stream against SGLang 0.5.23, one fact per test, over real HTTP.

Every test names the SGLang source it reads (paths under `sglang/srt/` in the
sglang-0.5.23 wheel). The facts here are those that decide whether a stream carries a
logprob for every sampled token: how steps are cut, which steps lose their logprobs, what
an engine with a parser does instead, and what the logprob entries hold.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from sessiongate.tokenizer import load_tokenizer
from support.procs import ServerProcess, mock_engine

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

MESSAGES = [{"role": "user", "content": "hi"}]
BODY = {"messages": MESSAGES, "logprobs": True, "return_output_ids_in_sglext": True}


@pytest.fixture(scope="module")
def plain() -> Iterator[ServerProcess]:
    """A default engine: no reasoning or tool-call parser, non-ASCII output."""
    with mock_engine("--non-ascii", "--completion-tokens", "40") as proc:
        yield proc


@pytest.fixture(scope="module")
def parsed() -> Iterator[ServerProcess]:
    with mock_engine("--non-ascii", "--tool-call-parser", "qwen25") as proc:
        yield proc


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer(None)


def stream(engine: ServerProcess, body: dict[str, Any]) -> list[Any]:
    events: list[Any] = []
    url = engine.url + "/v1/chat/completions"
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def whole(engine: ServerProcess, body: dict[str, Any]) -> dict[str, Any]:
    reply = httpx.post(
        engine.url + "/v1/chat/completions", json={**body, "return_meta_info": True}, timeout=30
    )
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def streamed_logprobs(events: list[Any]) -> list[dict[str, Any]]:
    return [
        entry
        for e in events
        if isinstance(e, dict) and e["choices"] and e["choices"][0]["logprobs"]
        for entry in e["choices"][0]["logprobs"]["content"]
    ]


def sglext_ids(events: list[Any]) -> list[int]:
    return next(
        e["sglext"]["output_ids"][0] for e in events if isinstance(e, dict) and "sglext" in e
    )


def test_default_engine_drops_the_logprobs_of_steps_without_text(plain: ServerProcess) -> None:
    # entrypoints/openai/serving_chat.py `_generate_stream_content`: on the plain-content path
    # a step's logprobs ride only on a content chunk, sent only `if delta`; the flush of
    # unattached logprobs runs only with a reasoning or tool-call parser (its comment says
    # why). managers/detokenizer_manager.py: a step whose text ends inside a character sends
    # only its printable prefix, and the stop token decodes to nothing (skip_special_tokens).
    # With --stream-interval 1 (server_args default) every token is its own step.
    for seed in range(6):
        body = {**BODY, "seed": seed}
        events = stream(plain, body)
        ref = whole(plain, body)
        ids = sglext_ids(events)
        lps = streamed_logprobs(events)
        steps = [e for e in events[1:] if isinstance(e, dict) and e["choices"]]
        steps = [s for s in steps if s["choices"][0]["finish_reason"] is None]
        # One token per step: a chunk never carries more than one logprob entry.
        assert all(len(s["choices"][0]["logprobs"]["content"]) == 1 for s in steps)
        assert all(s["choices"][0]["delta"]["content"] for s in steps)
        assert len(lps) < len(ids) == ref["meta_info"]["completion_tokens"]
        # What is streamed is the non-stream logprobs less the steps without text; the
        # last one (the end token) is always among them.
        assert lps[-1] != ref["logprobs"]["content"][-1]
        kept = iter(ref["logprobs"]["content"])
        assert all(entry in kept for entry in lps)  # an ordered subsequence


def test_parser_engine_flushes_every_steps_logprobs(parsed: ServerProcess) -> None:
    # entrypoints/openai/serving_chat.py `_generate_stream_content`: with a reasoning or
    # tool-call parser (`self.reasoning_parser or self.tool_call_parser`) the step's
    # unattached logprobs go out in a chunk of their own whose delta has no text.
    body = {**BODY, "seed": 2}
    events = stream(parsed, body)
    ref = whole(parsed, body)
    assert streamed_logprobs(events) == ref["logprobs"]["content"]
    alone = [
        e["choices"][0]
        for e in events[1:]
        if isinstance(e, dict) and e["choices"] and e["choices"][0]["logprobs"]
        if not e["choices"][0]["delta"].get("content")
    ]
    assert alone and all(c["delta"] == {"reasoning_content": None} for c in alone)
    info = httpx.get(parsed.url + "/model_info", timeout=10).json()
    assert info["tool_call_parser"] == "qwen25" and info["reasoning_parser"] is None


def test_role_chunk_and_status_line_wait_for_the_first_token() -> None:
    # entrypoints/openai/serving_chat.py `_generate_chat_stream` yields the role chunk inside
    # the loop over the engine's outputs (with the first one), and
    # `_handle_streaming_request` awaits that first chunk before the 200 goes out.
    with mock_engine("--ttft-ms", "600000") as engine:
        body = json.dumps({**BODY, "rid": "slow-1", "stream": True}).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        host, port = engine.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(head + body)
            while httpx.get(engine.url + "/mock/stats", timeout=10).json()["in_flight"] != 1:
                time.sleep(0.01)
            # A round trip through the same event loop: a status line already queued
            # would have been written by now.
            httpx.get(engine.url + "/health", timeout=10)
            sock.setblocking(False)
            with pytest.raises(BlockingIOError):
                sock.recv(1)
            sock.setblocking(True)
            # Abort it: the stream then starts (role chunk first) and ends as an abort.
            httpx.post(engine.url + "/abort_request", json={"rid": "slow-1"}, timeout=10)
            received = b""
            while b"data: [DONE]" not in received:
                piece = sock.recv(65536)
                assert piece
                received += piece
        assert received.startswith(b"HTTP/1.1 200")
        first = received.split(b"data: ", 2)[1].split(b"\n\n")[0]
        assert json.loads(first)["choices"][0]["delta"]["role"] == "assistant"


@pytest.mark.parametrize(
    ("field", "message"),
    [
        (
            "return_prompt_token_ids",
            "return_prompt_token_ids is not supported with streaming. "
            "Please set stream=false when using return_prompt_token_ids=true.",
        ),
        (
            "return_token_ids",
            "return_token_ids is not supported with streaming on /v1/chat/completions. "
            "Please set stream=false when using return_token_ids=true.",
        ),
    ],
)
def test_stream_with_token_ids_is_a_400(plain: ServerProcess, field: str, message: str) -> None:
    # entrypoints/openai/serving_chat.py `_convert_to_internal_request`: with `stream`, the
    # ValueError for return_prompt_token_ids, then return_token_ids, then return_meta_info;
    # serving_base.py answers a ValueError with err_type "BadRequest", status 400.
    reply = httpx.post(
        plain.url + "/v1/chat/completions",
        json={"messages": MESSAGES, "stream": True, field: True, "return_meta_info": True},
        timeout=30,
    )
    assert reply.status_code == 400
    assert reply.json() == {
        "object": "error",
        "message": message,
        "type": "BadRequest",
        "param": None,
        "code": 400,
    }


def test_logprob_bytes_come_from_the_token_id(plain: ServerProcess, tok: Any) -> None:
    # entrypoints/openai/serving_chat.py `_build_token_logprobs_from_raw`: for a byte-level
    # BPE tokenizer `bytes` is the token's own bytes (entrypoints/openai/utils.py
    # `token_id_to_bytes`), while `token` is the token decoded alone: "\ufffd" for a piece of
    # a multi-byte character.
    pieces = 0
    for seed in range(6):
        choice = whole(plain, {**BODY, "seed": seed})
        entries = choice["logprobs"]["content"]
        for entry, (_, token_id, _) in zip(
            entries, choice["meta_info"]["output_token_logprobs"], strict=True
        ):
            assert entry["token"] == tok.decode([token_id])
            if "\ufffd" in entry["token"]:
                pieces += 1
                assert entry["bytes"] != list(entry["token"].encode())
        text = bytes(b for e in entries[:-1] for b in e["bytes"]).decode()
        assert text == choice["message"]["content"]
    assert pieces  # the non-ASCII mix did split characters


def test_bad_routed_experts_start_len_streams_a_graceful_abort() -> None:
    # managers/scheduler.py `handle_generate_request`: a routed_experts_start_len out of
    # range aborts the request with FINISH_ABORT(message, HTTPStatus.BAD_REQUEST) after
    # replacing its prompt by one token (schedule_batch.py `set_finish_with_abort`). The
    # status reaches the tokenizer manager as a plain int (msgpack), so
    # `_generate_chat_stream`'s `isinstance(status_code, HTTPStatus)` is false: no error
    # chunk, the stream ends like a graceful abort. Non-stream,
    # tokenizer_manager.py `_handle_abort_finish_reason` compares the int to 400: a 400.
    with mock_engine("--r3-layers", "2", "--r3-topk", "2", "--r3-experts", "8") as engine:
        body = {
            **BODY,
            "input_ids": [5, 6, 7],
            "return_routed_experts": True,
            "routed_experts_start_len": 9,
            "stream_options": {"include_usage": True},
        }
        events = stream(engine, body)
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        finish, ext, usage, done = events[1:]
        assert finish["choices"][0]["finish_reason"] == "abort"
        assert finish["choices"][0]["matched_stop"] is None
        assert ext["sglext"] == {"output_ids": [[]]}
        assert usage["usage"]["prompt_tokens"] == 1
        assert usage["usage"]["completion_tokens"] == 0
        assert done == "[DONE]"
        reply = httpx.post(
            engine.url + "/v1/chat/completions",
            json={k: v for k, v in body.items() if k != "stream_options"},
            timeout=30,
        )
        assert reply.status_code == 400
        assert "is higher than the number of input tokens" in reply.json()["message"]


def test_cached_tokens_details_ride_in_the_sglext_chunk() -> None:
    # entrypoints/openai/serving_chat.py `_generate_chat_stream`: with
    # return_cached_tokens_details the sglext chunk carries `cached_tokens_details`
    # (protocol.py CachedTokensDetails: device, host), none when nothing was cached
    # (managers/scheduler_components/output_streamer.py `get_cached_tokens_details`);
    # usage carries cached tokens only with --enable-cache-report.
    with mock_engine() as engine:
        body = {**BODY, "input_ids": list(range(200, 240)), "return_cached_tokens_details": True}
        first = stream(engine, body)
        assert all("cached_tokens_details" not in e.get("sglext", {}) for e in first[:-1])
        again = stream(engine, body)
        ext = next(e["sglext"] for e in again[:-1] if "sglext" in e)
        assert ext["cached_tokens_details"] == {"device": 39, "host": 0}  # all but one token
        assert list(ext) == ["cached_tokens_details", "output_ids"]

"""`serve --stream-upstream relay` records every sampled token's logprob against an engine
that streams like SGLang 0.5.23 (the mock: one step per token, steps without text lose their
logprobs unless the engine runs a parser). Real `serve` and `mock-engine` processes.

Turns end by the stop token (its step has no text), by max_tokens, and inside multi-byte
characters (`--non-ascii`); each record must hold exactly the engine's ids and logprobs, as
the engine's own non-stream reply to the same prompt gives them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from support.gateways import gateway_over
from support.procs import ServerProcess, mock_engine

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs


@contextmanager
def relay_gateway(engine: ServerProcess) -> Iterator[httpx.Client]:
    with gateway_over(engine, "--stream-upstream", "relay") as client:
        yield client


@pytest.fixture(scope="module")
def plain() -> Iterator[ServerProcess]:
    """A default engine: no parser, so its stream drops logprobs."""
    with mock_engine("--non-ascii", "--completion-tokens", "40", "--enable-cache-report") as e:
        yield e


@pytest.fixture(scope="module")
def parsed() -> Iterator[ServerProcess]:
    """An engine with a tool-call parser: its stream flushes every step's logprobs."""
    with mock_engine("--non-ascii", "--completion-tokens", "40", "--tool-call-parser", "q") as e:
        yield e


def engine_reply(engine: ServerProcess, sent: dict[str, Any]) -> dict[str, Any]:
    """The engine's own non-stream reply to the request the gateway sent upstream."""
    body = {k: v for k, v in sent.items() if k not in ("stream", "stream_options")}
    body.update(stream=False, return_meta_info=True)
    reply = httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def streamed_turns(
    client: httpx.Client, engine: ServerProcess, tag: str, **extra: Any
) -> list[Any]:
    """Three streamed turns of one session; each record checked against the engine. `tag`
    keeps the session's prompts out of other sessions' prefix-cache hits."""
    sid = client.post("/sessions", json={}).json()["session_id"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"{tag}: écris 日本"}]
    finishes = []
    expected_cached = None
    for n in range(3):
        reply = client.post(
            f"/sessions/{sid}/v1/chat/completions",
            json={"messages": messages, "stream": True, "seed": n, **extra},
        )
        assert reply.status_code == 200
        events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-2:]
        chunks = [json.loads(e) for e in events[:-1]]
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        record = client.get(f"/sessions/{sid}").json()["records"][n]
        meta = record["response"]["choices"][0]["meta_info"]
        ref = engine_reply(engine, record["request"])
        # Every sampled token, its id and its logprob, exactly as the engine sampled them.
        assert [e[:2] for e in meta["output_token_logprobs"]] == [
            e[:2] for e in ref["meta_info"]["output_token_logprobs"]
        ]
        assert meta["completion_tokens"] == ref["meta_info"]["completion_tokens"]
        assert content == ref["message"]["content"]
        if expected_cached is not None:
            assert record["cached_tokens"] == expected_cached
        # The engine's cache keeps the prompt and all but the last sampled token.
        expected_cached = len(record["request"]["input_ids"]) + meta["completion_tokens"] - 1
        finishes.append(record["finish_reason"])
        messages = [
            *messages,
            {"role": "assistant", "content": content},
            {"role": "user", "content": "encore"},
        ]
    return finishes


def mock_requests(engine: ServerProcess, last: int) -> list[dict[str, Any]]:
    reply = httpx.get(engine.url + "/mock/requests", params={"last": last}, timeout=10)
    requests: list[dict[str, Any]] = reply.json()["requests"]
    return requests


def buffered_turns(client: httpx.Client, until: int) -> int:
    """/health's relay_buffered_turns once the worker's heartbeat says `until` (the count
    travels with heartbeats), or what it says after a few beats."""
    deadline = time.monotonic() + 5.0
    while True:
        [worker] = client.get("/health").json()["workers"]
        count: int = worker["relay_buffered_turns"]
        if count == until or time.monotonic() > deadline:
            return count
        time.sleep(0.1)


def test_default_engine_stop_turns_record_every_logprob(plain: ServerProcess) -> None:
    with relay_gateway(plain) as gw:
        assert streamed_turns(gw, plain, "stop") == ["stop"] * 3
        assert buffered_turns(gw, until=3) == 3
    # Served buffered: this engine's stream cannot carry every logprob.
    assert all(r["stream"] is False for r in mock_requests(plain, 6))


def test_default_engine_length_turns_record_every_logprob(plain: ServerProcess) -> None:
    with relay_gateway(plain) as gw:
        assert streamed_turns(gw, plain, "length", max_tokens=7) == ["length"] * 3


def test_parser_engine_turns_are_relayed_and_exact(parsed: ServerProcess) -> None:
    with relay_gateway(parsed) as gw:
        assert streamed_turns(gw, parsed, "stop") == ["stop"] * 3
        assert streamed_turns(gw, parsed, "length", max_tokens=7) == ["length"] * 3
        assert buffered_turns(gw, until=0) == 0
    # Relayed: each of the six turns asked the engine for a stream (the other requests are
    # this test's own non-stream references), with what the record needs.
    streamed = [r for r in mock_requests(parsed, 12) if r["stream"] is True]
    assert len(streamed) == 6
    assert all(r["return_cached_tokens_details"] is True for r in streamed)

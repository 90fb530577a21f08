"""The mock engine's stateless `/v1/messages` and `/v1/messages/count_tokens`, as SGLang
0.5.23 serves them (http_server.py `anthropic_v1_messages`, `anthropic_v1_count_tokens`;
anthropic/serving.py `handle_messages`, `handle_count_tokens`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from sessiongate.mock_engine.app import create_app
from sessiongate.mock_engine.config import MockEngineConfig

TOOLS = [
    {
        "name": "get_weather",
        "description": "weather",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


@pytest.fixture
def client() -> Iterator[TestClient]:
    config = MockEngineConfig(reasoning_parser="qwen3", tool_call_rate=1.0)
    with TestClient(create_app(config)) as c:
        yield c


def ask(client: TestClient, **extra: Any) -> Any:
    body = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}
    return client.post("/v1/messages", json={**body, **extra})


def test_reply_has_thinking_text_and_tool_use(client: TestClient) -> None:
    """`handle_messages` -> `_convert_response`: blocks from the chat reply, tool_use input
    parsed, stop_reason tool_use, the chat route sent the converted body."""
    reply = ask(client, tools=TOOLS)
    assert reply.status_code == 200, reply.text
    message = reply.json()
    assert message["type"] == "message" and message["id"].startswith("msg_")
    kinds = [b["type"] for b in message["content"]]
    assert kinds[0] == "thinking" and kinds[-1] == "tool_use"
    assert message["stop_reason"] == "tool_use"
    assert isinstance(message["content"][-1]["input"], dict)
    assert message["usage"]["input_tokens"] > 0 and message["usage"]["output_tokens"] > 0
    sent = client.get("/mock/requests").json()["requests"][-1]
    assert sent["tools"][0]["function"]["name"] == "get_weather"
    assert sent["tool_choice"] == "auto"


def test_stream_events(client: TestClient) -> None:
    """`_generate_anthropic_stream`: the event sequence for a whole reply."""
    reply = ask(client, stream=True)
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/event-stream")
    kinds = [
        line.removeprefix("event: ")
        for line in reply.text.splitlines()
        if line.startswith("event: ")
    ]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert "content_block_start" in kinds


def test_thinking_disabled_turns_reasoning_off(client: TestClient) -> None:
    """`apply_reasoning_enabled`: enable_thinking false -> no thinking block."""
    message = ask(client, thinking={"type": "disabled"}).json()
    assert all(b["type"] != "thinking" for b in message["content"])


def test_refusals_are_anthropic_envelopes(client: TestClient) -> None:
    """http_server.py's handlers and `handle_messages`: 400 invalid_request_error."""
    for extra in ({"max_tokens": 0}, {"messages": [{"role": "user", "content": [{"type": "x"}]}]}):
        reply = ask(client, **extra)
        assert reply.status_code == 400
        assert reply.json()["type"] == "error"
        assert reply.json()["error"]["type"] == "invalid_request_error"
    reply = client.post("/v1/messages", content=b"{}", headers={"content-type": "text/plain"})
    assert reply.status_code == 400 and reply.json()["type"] == "error"


def test_thinking_without_a_parser_is_refused() -> None:
    """serving_chat.py `apply_reasoning_enabled` without a reasoning parser."""
    with TestClient(create_app(MockEngineConfig())) as c:
        reply = ask(c, thinking={"type": "enabled", "budget_tokens": 2048})
    assert reply.status_code == 400
    assert "reasoning parser" in reply.json()["error"]["message"]


def test_count_tokens(client: TestClient) -> None:
    """`handle_count_tokens`: the prompt length of the converted chat body."""
    reply = client.post(
        "/v1/messages/count_tokens",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert reply.status_code == 200
    short = reply.json()["input_tokens"]
    longer = client.post(
        "/v1/messages/count_tokens",
        json={"model": "m", "system": "be brief", "messages": [{"role": "user", "content": "hi"}]},
    ).json()["input_tokens"]
    assert 0 < short < longer

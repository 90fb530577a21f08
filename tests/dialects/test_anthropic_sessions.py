"""Anthropic Messages sessions through a real `serve` and the real mock engine, driven by the
real `anthropic` SDK: a 10-turn agent session (thinking, tool_use answered with tool_result
blocks, streamed and not) in both layouts, and hostile bodies refused in Anthropic's envelope
without touching the session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from session.test_tito_agent_sessions import AGENT_TEMPLATES
from support.family_templates import family_tokenizer_dir
from support.procs import ServerProcess, free_port, mock_engine

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

TURNS = 10
TOOLS: list[Any] = [
    {
        "name": "get_weather",
        "description": "Weather for a city.",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    }
]
MAX_BODY = 64 * 1024


# (family, workers): both layouts, and model families whose turns end differently (GLM 4.7
# stops at the next message's opener; Kimi has no newline after its end token).
DEPLOYMENTS = [("qwen3", "0"), ("qwen3", "2"), ("glm47", "0"), ("kimi26", "2")]


@pytest.fixture(scope="module", params=DEPLOYMENTS, ids=[f"{f}-workers{w}" for f, w in DEPLOYMENTS])
def gateway(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    """(gateway URL, engine URL): `serve --workers N` over a mock engine with reasoning, both
    on the family's agent template of tests/session/test_tito_agent_sessions.py (it spells
    turns as the mock samples them, so the mismatch report must be empty)."""
    family, workers = request.param
    template, eos = AGENT_TEMPLATES[family]
    directory: Path = family_tokenizer_dir(
        tmp_path_factory.mktemp(family), family, template=template, eos=eos
    )
    engine_args = ["--tokenizer", str(directory), "--reasoning-parser", "qwen3"]
    engine_args += ["--tool-call-rate", "0.5", "--completion-tokens", "24"]
    with mock_engine(*engine_args) as engine:
        port = free_port()
        argv = ["serve", "--port", str(port), "--workers", workers, "--backend", engine.url]
        argv += ["--tokenizer", str(directory), "--tito-model", family]
        argv += ["--chat-template-path", str(directory / "chat_template.jinja")]
        argv += ["--max-body-bytes", str(MAX_BODY)]
        with ServerProcess(argv, port, timeout=60) as proc:
            yield proc.url, engine.url


def new_session(url: str) -> str:
    sid: str = httpx.post(url + "/sessions", json={}).json()["session_id"]
    return sid


def sdk(url: str, sid: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"{url}/sessions/{sid}", api_key="x", max_retries=0)


def ask(client: anthropic.Anthropic, messages: list[Any], stream: bool) -> anthropic.types.Message:
    kwargs: dict[str, Any] = {
        "model": "mock",
        "max_tokens": 64,
        "system": "You are a helper.",
        "messages": messages,
        "tools": TOOLS,
    }
    if stream:
        with client.messages.stream(**kwargs) as events:
            kinds = [event.type for event in events]
            message = events.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        return message
    return client.messages.create(**kwargs)


def test_ten_turn_agent_session(gateway: tuple[str, str]) -> None:
    url, engine_url = gateway
    sid = new_session(url)
    client = sdk(url, sid)
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    calls = 0
    for index in range(TURNS):
        message = ask(client, messages, stream=index % 2 == 1)
        kinds = [block.type for block in message.content]
        assert kinds[0] == "thinking", kinds  # the mock reasons first (--reasoning-parser)
        messages.append(
            {
                "role": "assistant",
                "content": [b.model_dump(exclude_none=True) for b in message.content],
            }
        )
        uses = [block for block in message.content if block.type == "tool_use"]
        if uses:
            calls += 1
            assert message.stop_reason == "tool_use"
            assert all(isinstance(block.input, dict) for block in uses)
            results = [
                {"type": "tool_result", "tool_use_id": block.id, "content": f"{index * 3 + 1} C"}
                for block in uses
            ]
            messages.append({"role": "user", "content": results})
        else:
            messages.append({"role": "user", "content": f"And tomorrow, day {index}?"})
    assert 0 < calls < TURNS  # both tool calls and plain answers

    session = httpx.get(f"{url}/sessions/{sid}").json()
    sent = httpx.get(engine_url + "/mock/requests", params={"last": 100}).json()["requests"]
    assert session["metadata"]["tito_session_mismatch"] == []
    assert session["metadata"]["tito_session_mismatch_detail"] == []
    records = session["records"]
    assert len(records) == TURNS
    by_prompt = {tuple(body["input_ids"]): body for body in sent if "input_ids" in body}
    for index, record in enumerate(records):
        assert record["dialect"] == "anthropic"
        assert record["path"] == "/v1/chat/completions"
        assert record["client_request"]["messages"] == messages[: 2 * index + 1]
        assert bool(record["client_request"].get("stream")) == (index % 2 == 1)
        # The engine received exactly the recorded chat body's prompt ids.
        assert tuple(record["request"]["input_ids"]) in by_prompt
        assert record["request"]["stream"] is False
        assert record["request"]["tools"][0]["function"]["name"] == "get_weather"


def envelope(reply: httpx.Response, status: int, kind: str) -> str:
    assert reply.status_code == status, reply.text
    document = reply.json()
    assert document["type"] == "error" and document["error"]["type"] == kind, document
    message: str = document["error"]["message"]
    return message


HOSTILE: list[tuple[str, Any, str]] = [
    (
        "unknown block",
        {"messages": [{"role": "user", "content": [{"type": "video"}]}]},
        "content.0",
    ),
    (
        "orphan tool_result",
        {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]},
        "tool_use_id",
    ),
    ("max_tokens a string", {"max_tokens": "5"}, "max_tokens"),
    ("messages an object", {"messages": {"role": "user"}}, "messages"),
    (
        "text a number",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
        "text",
    ),
    ("bad role", {"messages": [{"role": "tool", "content": "x"}]}, "role"),
    (
        "redacted thinking",
        {"messages": [{"role": "assistant", "content": [{"type": "redacted_thinking"}]}]},
        "redacted",
    ),
    ("stream a string", {"stream": "yes"}, "stream"),
]


@pytest.mark.parametrize(("name", "extra", "named"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_bodies_are_refused_in_the_envelope(
    gateway: tuple[str, str], name: str, extra: dict[str, Any], named: str
) -> None:
    url, _ = gateway
    sid = new_session(url)
    client = sdk(url, sid)
    client.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    before = httpx.get(f"{url}/sessions/{sid}").json()
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **extra}
    reply = httpx.post(f"{url}/sessions/{sid}/v1/messages", json=body)
    assert named in envelope(reply, 400, "invalid_request_error")
    assert httpx.get(f"{url}/sessions/{sid}").json() == before


def test_gateway_refusals_are_in_the_envelope(gateway: tuple[str, str]) -> None:
    url, _ = gateway
    sid = new_session(url)
    path = f"{url}/sessions/{sid}/v1/messages"
    envelope(httpx.post(path, content=b"{not json"), 400, "invalid_request_error")
    envelope(httpx.post(path, content=b"[1]"), 400, "invalid_request_error")
    big = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x" * MAX_BODY}]}
    envelope(httpx.post(path, json=big), 413, "request_too_large")
    envelope(
        httpx.post(f"{url}/sessions/{'0' * 32}/v1/messages", json=big), 413, "request_too_large"
    )
    small = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    envelope(
        httpx.post(f"{url}/sessions/{'0' * 32}/v1/messages", json=small), 404, "not_found_error"
    )
    # The SDK raises its typed errors from the envelope.
    with pytest.raises(anthropic.NotFoundError):
        sdk(url, "0" * 32).messages.create(**small)
    session = httpx.get(f"{url}/sessions/{sid}").json()
    assert session["records"] == []
    # Without a session the engine answers `/v1/messages` itself (relayed statelessly).
    assert httpx.post(f"{url}/v1/messages", json=small).json()["type"] == "message"

"""Dialect turns under `serve --stream-upstream relay`: the engine's chat stream converted to
the dialect's events as it arrives must come to what the buffered path's events come to.

Real processes: one mock engine (`--reasoning-parser qwen3 --tool-call-rate 0.5`, so turns
think, answer and call tools) behind two gateways, one `--stream-upstream buffered`, one
`relay`. The same first turn asked of a fresh session on each gets the same engine reply (the
mock samples from the prompt), so the real SDKs' accumulation of both streams
(`client.messages.stream(...).get_final_message()`,
`client.responses.stream(...).get_final_response()`) must give equal results, ids and
timestamps aside. Then a several-turn relayed session in each dialect must record like a
chat turn: no `tito_session_mismatch`, and each record's prompt ids those the engine
received.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from session.test_tito_agent_sessions import AGENT_TEMPLATES
from support.family_templates import family_tokenizer_dir
from support.procs import ServerProcess, free_port, mock_engine

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

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
CITIES = ["Paris", "Oslo", "Lima", "Kyoto", "Cairo", "Quito", "Perth", "Riga"]
FAMILY = "qwen3"


@pytest.fixture(scope="module")
def gateways(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """{"buffered": url, "relay": url, "engine": url} over one mock engine."""
    template, eos = AGENT_TEMPLATES[FAMILY]
    directory: Path = family_tokenizer_dir(
        tmp_path_factory.mktemp(FAMILY), FAMILY, template=template, eos=eos
    )
    engine_args = ["--tokenizer", str(directory), "--reasoning-parser", "qwen3"]
    engine_args += ["--tool-call-rate", "0.5", "--completion-tokens", "24"]
    with ExitStack() as stack:
        engine = stack.enter_context(mock_engine(*engine_args))
        urls = {"engine": engine.url}
        for mode in ("buffered", "relay"):
            port = free_port()
            argv = ["serve", "--port", str(port), "--workers", "0", "--backend", engine.url]
            argv += ["--tokenizer", str(directory), "--tito-model", FAMILY]
            argv += ["--chat-template-path", str(directory / "chat_template.jinja")]
            argv += ["--stream-upstream", mode]
            urls[mode] = stack.enter_context(ServerProcess(argv, port, timeout=60)).url
        yield urls


def new_session(url: str) -> str:
    sid: str = httpx.post(url + "/sessions", json={}).json()["session_id"]
    return sid


def anthropic_sdk(url: str, sid: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"{url}/sessions/{sid}", api_key="x", max_retries=0)


def streamed_message(client: anthropic.Anthropic, messages: list[Any]) -> tuple[Any, list[str]]:
    """The SDK's final message of a streamed turn, and the event types it saw."""
    with client.messages.stream(
        model="mock",
        max_tokens=64,
        system="You are a helper.",
        messages=messages,
        tools=TOOLS,
    ) as stream:
        kinds = [event.type for event in stream]
        message = stream.get_final_message()
    return message, kinds


def _without_ids(message: Any) -> dict[str, Any]:
    dumped: dict[str, Any] = message.model_dump()
    dumped.pop("id")
    return dumped


def _block_events(kinds: list[str]) -> list[str]:
    """The SDK's raw event kinds (its derived `text` / `thinking` / `input_json` events and
    the number of deltas depend on how deltas are split)."""
    raw = [k for k in kinds if k.startswith(("message_", "content_block_"))]
    return [k for i, k in enumerate(raw) if k != "content_block_delta" or raw[i - 1] != k]


def test_anthropic_relay_equals_buffered(gateways: dict[str, str]) -> None:
    tool_turns = 0
    for city in CITIES:
        messages = [{"role": "user", "content": f"Weather in {city}?"}]
        results = {}
        for mode in ("buffered", "relay"):
            url = gateways[mode]
            message, kinds = streamed_message(anthropic_sdk(url, new_session(url)), messages)
            results[mode] = (_without_ids(message), _block_events(kinds))
        assert results["relay"] == results["buffered"], city
        tool_turns += results["relay"][0]["stop_reason"] == "tool_use"
    assert 0 < tool_turns < len(CITIES)  # both kinds of reply were compared


def test_anthropic_relayed_session_records_like_chat(gateways: dict[str, str]) -> None:
    url, engine_url = gateways["relay"], gateways["engine"]
    sid = new_session(url)
    client = anthropic_sdk(url, sid)
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    turns = 6
    for index in range(turns):
        message, kinds = streamed_message(client, messages)
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        assert message.content[0].type == "thinking"
        blocks = [b.model_dump(exclude_none=True) for b in message.content]
        messages.append({"role": "assistant", "content": blocks})
        uses = [block for block in message.content if block.type == "tool_use"]
        if uses:
            results = [
                {"type": "tool_result", "tool_use_id": b.id, "content": f"{index} C"} for b in uses
            ]
            messages.append({"role": "user", "content": results})
        else:
            messages.append({"role": "user", "content": f"And tomorrow, day {index}?"})
    session = httpx.get(f"{url}/sessions/{sid}").json()
    sent = httpx.get(engine_url + "/mock/requests", params={"last": 100}).json()["requests"]
    assert session["metadata"]["tito_session_mismatch"] == []
    records = session["records"]
    assert len(records) == turns
    by_prompt = {tuple(body["input_ids"]): body for body in sent if "input_ids" in body}
    for index, record in enumerate(records):
        assert record["dialect"] == "anthropic"
        assert record["client_request"]["messages"] == messages[: 2 * index + 1]
        # The engine received exactly the recorded prompt ids, and streamed the turn.
        engine_body = by_prompt[tuple(record["request"]["input_ids"])]
        assert engine_body["stream"] is True
        assert record["request"]["stream"] is True


RESPONSE_TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
]


def openai_sdk(url: str, sid: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/sessions/{sid}/v1", api_key="x", max_retries=0)


def streamed_response(client: openai.OpenAI, **kwargs: Any) -> tuple[Any, list[str]]:
    """The SDK's final response of a streamed turn, and the event types it saw."""
    kwargs = {"model": "mock", "tools": RESPONSE_TOOLS, "max_output_tokens": 64, **kwargs}
    with client.responses.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        response = stream.get_final_response()
    return response, kinds


def _response_without_ids(response: Any) -> dict[str, Any]:
    dumped: dict[str, Any] = response.model_dump()
    dumped.pop("id")
    dumped.pop("created_at")
    for item in dumped["output"]:
        item.pop("id")
    return dumped


def _collapsed(kinds: list[str]) -> list[str]:
    """Event kinds with runs of one delta kind counted once (deltas may be split)."""
    return [k for i, k in enumerate(kinds) if not k.endswith(".delta") or kinds[i - 1] != k]


def test_responses_relay_equals_buffered(gateways: dict[str, str]) -> None:
    tool_turns = 0
    for city in CITIES:
        results = {}
        for mode in ("buffered", "relay"):
            url = gateways[mode]
            client = openai_sdk(url, new_session(url))
            response, kinds = streamed_response(client, input=f"Weather in {city}?")
            results[mode] = (_response_without_ids(response), _collapsed(kinds))
        assert results["relay"] == results["buffered"], city
        outputs = results["relay"][0]["output"]
        tool_turns += any(item["type"] == "function_call" for item in outputs)
    assert 0 < tool_turns < len(CITIES)  # both kinds of reply were compared


def test_responses_relayed_session_records_like_chat(gateways: dict[str, str]) -> None:
    url, engine_url = gateways["relay"], gateways["engine"]
    sid = new_session(url)
    client = openai_sdk(url, sid)
    # Chained by previous_response_id: each relayed turn must be remembered under its id.
    response, _ = streamed_response(client, input="Weather in Paris?", instructions="Be brief.")
    turns = 6
    for index in range(turns - 1):
        calls = [item for item in response.output if item.type == "function_call"]
        follow: list[Any] = [
            {"type": "function_call_output", "call_id": c.call_id, "output": f"{index} C"}
            for c in calls
        ] or [{"role": "user", "content": f"And tomorrow, day {index}?"}]
        response, kinds = streamed_response(
            client, input=follow, previous_response_id=response.id, instructions="Be brief."
        )
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
        assert response.output[0].type == "reasoning"
    session = httpx.get(f"{url}/sessions/{sid}").json()
    sent = httpx.get(engine_url + "/mock/requests", params={"last": 200}).json()["requests"]
    assert session["metadata"]["tito_session_mismatch"] == []
    records = session["records"]
    assert len(records) == turns
    by_prompt = {tuple(body["input_ids"]): body for body in sent if "input_ids" in body}
    for record in records:
        assert record["dialect"] == "responses"
        assert by_prompt[tuple(record["request"]["input_ids"])]["stream"] is True
        assert record["request"]["stream"] is True

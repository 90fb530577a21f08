"""The mock engine's `POST /v1/responses` against the real `openai` SDK
(`client.responses.create`), as a stateless SGLang 0.5.23 answers it (serving_responses.py
through sessiongate.dialects.responses; docs/mock-engine.md, "Responses")."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from sessiongate.mock_engine.responses_api import STORE_DISABLED
from support.procs import ServerProcess, mock_engine

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

MODEL = "sessiongate-mock"
TOOL: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.fixture(scope="module")
def engine() -> Iterator[ServerProcess]:
    with mock_engine("--reasoning-parser", "qwen3", "--tool-call-rate", "1") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(engine: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=engine.url + "/v1", api_key="none", max_retries=0) as sdk:
        yield sdk


def test_text_response_matches_the_chat_route(client: openai.OpenAI) -> None:
    """The prompt is the chat prompt SGLang renders (instructions -> system), so the mock's
    deterministic reply equals the chat route's; the SDK parses the Response."""
    response = client.responses.create(model=MODEL, instructions="Be brief.", input="Hi")
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    )
    message = chat.choices[0].message
    assert response.status == "completed" and response.id.startswith("resp_")
    assert response.output_text == message.content
    assert [item.type for item in response.output] == ["reasoning", "message"]
    reasoning = response.output[0]
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert reasoning.content[0].text == getattr(message, "reasoning_content", None)
    assert chat.usage is not None and response.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_function_call_and_store_false_follow_up(client: openai.OpenAI) -> None:
    """Function tools become function_call items; a store=false client resends the output
    with a function_call_output and gets the next turn."""
    first = client.responses.create(
        model=MODEL, input="Weather in Paris?", tools=[TOOL], store=False
    )  # type: ignore[arg-type]
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    follow_up: list[Any] = [
        {"role": "user", "content": "Weather in Paris?"},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"},
    ]
    second = client.responses.create(model=MODEL, input=follow_up, tools=[TOOL], store=False)  # type: ignore[arg-type]
    assert second.status == "completed" and second.output


def test_custom_tool_call(client: openai.OpenAI) -> None:
    """A custom tool goes out as SGLang's string shim; the call comes back as a
    custom_tool_call with the decoded payload, streamed or not."""
    tool: Any = {"type": "custom", "name": "apply_patch", "description": "Apply a patch"}
    response = client.responses.create(model=MODEL, input="Fix it", tools=[tool])
    (call,) = [item for item in response.output if item.type == "custom_tool_call"]
    assert call.name == "apply_patch" and isinstance(call.input, str)
    events = list(client.responses.create(model=MODEL, input="Fix it", tools=[tool], stream=True))
    done = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    assert [e.input for e in done] == [call.input]


def test_stream_events(client: openai.OpenAI) -> None:
    """stream=true: the SDK parses every event; created .. completed, in sequence, and the
    text deltas add up to the final message."""
    stream = client.responses.create(model=MODEL, input="Hi", stream=True)
    events = list(stream)
    types = [event.type for event in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1]
    assert final.type == "response.completed" and final.response.output_text == deltas
    plain = client.responses.create(model=MODEL, input="Hi")
    assert plain.output_text == deltas


def test_max_output_tokens_is_incomplete(client: openai.OpenAI) -> None:
    """max_output_tokens (less SGLang's 2 of headroom) cuts the reply: status incomplete."""
    response = client.responses.create(model=MODEL, input="Hi", max_output_tokens=5)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.usage is not None and response.usage.output_tokens == 3


def test_logprobs_included(client: openai.OpenAI) -> None:
    """include message.output_text.logprobs: the output text carries a logprob for every
    generated token, the reasoning's included (serving_responses.py
    `_build_output_text_logprobs`; non-stream only). The mock's chat has no top logprobs."""
    response = client.responses.create(
        model=MODEL, input="Hi", include=["message.output_text.logprobs"], top_logprobs=2
    )
    message = next(item for item in response.output if item.type == "message")
    logprobs = message.content[0].logprobs  # type: ignore[union-attr]
    assert response.usage is not None and logprobs is not None
    assert len(logprobs) == response.usage.output_tokens
    assert logprobs[0].token == "<think>" and logprobs[0].bytes == list(b"<think>")


def test_refusals(client: openai.OpenAI, engine: ServerProcess) -> None:
    """Stateless SGLang refuses previous_response_id (its store is off), an unknown model
    (404), built-in tools (sessiongate's dialect) in the {"error": {...}} envelope."""
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_1")
    assert info.value.body == {
        "message": STORE_DISABLED,
        "type": "invalid_request_error",
        "param": "previous_response_id",
        "code": 400,
    }
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="x")
    reply = httpx.post(
        engine.url + "/v1/responses",
        json={"model": MODEL, "input": "x", "tools": [{"type": "web_search"}]},
    )
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "tools"

"""OpenAI Responses sessions through a real `serve` and the real mock engine, driven by the
real `openai` SDK (`client.responses.create`): a 10-turn agent session as agent CLIs run it
(`store: false`, the whole input resent, function calls answered with function_call_output
items, streamed and not) and one chained by `previous_response_id`, in both layouts; a mixed
session (chat, then Anthropic messages, then responses) is one trajectory; hostile bodies are
refused in the route's envelope without touching the session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from session.test_tito_agent_sessions import AGENT_TEMPLATES
from sessiongate.demo.verify import trajectory_problems
from support.family_templates import family_tokenizer_dir
from support.procs import ServerProcess, free_port, mock_engine

pytestmark = pytest.mark.procs

TURNS = 10
TOOLS: list[Any] = [
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


# (family, workers): both layouts, and model families whose turns end differently (GLM 4.7
# stops at the next message's opener; Kimi has no newline after its end token).
DEPLOYMENTS = [("qwen3", "0"), ("qwen3", "2"), ("glm47", "0"), ("kimi26", "2")]


@pytest.fixture(scope="module", params=DEPLOYMENTS, ids=[f"{f}-workers{w}" for f, w in DEPLOYMENTS])
def gateway(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    """(gateway URL, engine URL) on the family's agent template (turns spelled as the mock
    samples them, so the mismatch report must be empty)."""
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
        with ServerProcess(argv, port, timeout=60) as proc:
            yield proc.url, engine.url


def new_session(url: str) -> str:
    sid: str = httpx.post(url + "/sessions", json={}).json()["session_id"]
    return sid


def sdk(url: str, sid: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/sessions/{sid}/v1", api_key="x", max_retries=0)


def ask(client: openai.OpenAI, stream: bool, **kwargs: Any) -> Any:
    kwargs = {"model": "mock", "tools": TOOLS, "max_output_tokens": 64, **kwargs}
    if stream:
        with client.responses.stream(**kwargs) as events:
            kinds = [event.type for event in events]
            response = events.get_final_response()
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
        return response
    return client.responses.create(**kwargs)


def answers(response: Any, index: int) -> list[dict[str, Any]]:
    """The agent's next input items: each function call's output, else a user message."""
    calls = [item for item in response.output if item.type == "function_call"]
    if calls:
        return [
            {"type": "function_call_output", "call_id": c.call_id, "output": f"{index} C"}
            for c in calls
        ]
    return [{"role": "user", "content": f"And tomorrow, day {index}?"}]


def check_session(url: str, engine_url: str, sid: str) -> list[dict[str, Any]]:
    session = httpx.get(f"{url}/sessions/{sid}").json()
    sent = httpx.get(engine_url + "/mock/requests", params={"last": 200}).json()["requests"]
    assert session["metadata"]["tito_session_mismatch"] == []
    assert trajectory_problems(session) == []
    prompts = {tuple(body["input_ids"]) for body in sent if "input_ids" in body}
    for record in session["records"]:
        assert tuple(record["request"]["input_ids"]) in prompts
    records: list[dict[str, Any]] = session["records"]
    return records


def test_ten_turn_agent_session_resending_the_whole_input(gateway: tuple[str, str]) -> None:
    url, engine_url = gateway
    sid = new_session(url)
    client = sdk(url, sid)
    items: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    calls = 0
    for index in range(TURNS):
        response = ask(client, index % 2 == 1, input=items, store=False, instructions="Be brief.")
        assert response.status in ("completed", "incomplete")
        kinds = [item.type for item in response.output]
        assert kinds[0] == "reasoning", kinds
        calls += "function_call" in kinds
        items += [item.model_dump(exclude_none=True) for item in response.output]
        items += answers(response, index)
    assert 0 < calls < TURNS
    records = check_session(url, engine_url, sid)
    assert len(records) == TURNS
    assert all(r["dialect"] == "responses" for r in records)


def test_previous_response_id_continues_from_the_sessions_own_turns(
    gateway: tuple[str, str],
) -> None:
    url, engine_url = gateway
    sid = new_session(url)
    client = sdk(url, sid)
    response = ask(client, False, input="Weather in Paris?", instructions="Be brief.")
    for index in range(4):
        response = ask(
            client,
            index % 2 == 0,
            input=answers(response, index),
            previous_response_id=response.id,
            instructions="Be brief.",
        )
    assert len(check_session(url, engine_url, sid)) == 5
    # Another session's id is not this session's: 404 in the route's envelope.
    other = sdk(url, new_session(url))
    with pytest.raises(openai.NotFoundError, match="not found"):
        other.responses.create(model="m", input="hi", previous_response_id=response.id)


def test_a_mixed_session_is_one_trajectory(gateway: tuple[str, str]) -> None:
    # chat, then Anthropic messages, then responses: each continues the same history.
    url, engine_url = gateway
    sid = new_session(url)
    chat = httpx.post(
        f"{url}/sessions/{sid}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hello"}]},
    ).json()
    said = chat["choices"][0]["message"]
    history: list[dict[str, Any]] = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": said.get("content") or ""},
    ]
    if said.get("reasoning_content"):
        thinking = {"type": "thinking", "thinking": said["reasoning_content"], "signature": ""}
        history[1]["content"] = [thinking, {"type": "text", "text": said["content"] or ""}]
    # (no tools declared: the mock answers in text)
    messages = httpx.post(
        f"{url}/sessions/{sid}/v1/messages",
        json={
            "model": "m",
            "max_tokens": 32,
            "messages": [*history, {"role": "user", "content": "More?"}],
        },
    )
    assert messages.status_code == 200, messages.text
    blocks = messages.json()["content"]
    reasoning = "".join(b["thinking"] for b in blocks if b["type"] == "thinking")
    text = "".join(b["text"] for b in blocks if b["type"] == "text")

    def said_items(reasoning: str | None, text: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        if reasoning:
            items.append(
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": reasoning}]}
            )
        return [*items, {"role": "assistant", "content": text}]

    items: list[dict[str, Any]] = [
        {"role": "user", "content": "Hello"},
        *said_items(said.get("reasoning_content"), said.get("content") or ""),
        {"role": "user", "content": "More?"},
        *said_items(reasoning, text),
        {"role": "user", "content": "Last one?"},
    ]
    response = sdk(url, sid).responses.create(model="m", input=items, store=False)
    assert response.status == "completed" or response.status == "incomplete"
    records = check_session(url, engine_url, sid)
    assert [r.get("dialect") for r in records] == [None, "anthropic", "responses"]
    assert [r["rollback_steps"] for r in records] == [0, 0, 0]
    lengths = [len(r["request"]["input_ids"]) for r in records]
    assert lengths == sorted(lengths) and len(set(lengths)) == 3


HOSTILE: list[tuple[str, dict[str, Any], int]] = [
    ("input a number", {"input": 5}, 400),
    ("built-in tool", {"input": "hi", "tools": [{"type": "web_search"}]}, 400),
    ("background", {"input": "hi", "background": True}, 400),
    ("unknown item", {"input": [{"type": "video"}]}, 400),
    ("previous id malformed", {"input": "hi", "previous_response_id": "abc"}, 400),
    ("previous id unknown", {"input": "hi", "previous_response_id": "resp_00"}, 404),
]


@pytest.mark.parametrize(("name", "body", "status"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_bodies_are_refused_in_the_envelope(
    gateway: tuple[str, str], name: str, body: dict[str, Any], status: int
) -> None:
    url, _ = gateway
    sid = new_session(url)
    sdk(url, sid).responses.create(model="m", input="hi", store=False)
    before = httpx.get(f"{url}/sessions/{sid}").json()
    reply = httpx.post(f"{url}/sessions/{sid}/v1/responses", json={"model": "m", **body})
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert isinstance(error["message"], str) and error["code"] == status
    assert httpx.get(f"{url}/sessions/{sid}").json() == before

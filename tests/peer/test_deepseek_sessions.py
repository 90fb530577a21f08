"""A 10-turn DeepSeek agent session (reasoning every turn, DSML tool calls answered with tool
results, a final answer) through a real `serve` on the real DeepSeek V4 vocabulary, for V4 and
V3.2 (`--tito-model deepseekv4|deepseekv32`, no template: DeepSeek's encoders).

The engine is the replay engine (support/replay_engine.py): each turn it answers with the
scripted assistant message and, as sampled ids, what the model would emit for it: the
rollout framework's own rendering of the history with that message, after the prompt,
through the end-of-sentence token (miles_tito_tokenizers template.py, an independent
renderer). Every turn must be 200, every prompt the one the engine received and the
framework's `merge_tokens` of the previous turn, the records the engine's ids, and the
session's `tito_session_mismatch` empty.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from support.procs import ServerProcess, free_port
from support.vocabularies import deepseek_v4_dir, hf_tokenizer

mtt_template = pytest.importorskip("miles_tito_tokenizers.template")
mtt_types = pytest.importorskip("miles_tito_tokenizers.tokenizer_type")

pytestmark = pytest.mark.procs

TESTS_DIR = Path(__file__).resolve().parents[1]
MODEL_TYPES = {"deepseekv4": "deepseek_v4", "deepseekv32": "deepseek_v32"}
EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"
TURNS = 10
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the notes for a query",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["query"],
            },
        },
    }
]


def assistant_turn(index: int) -> dict[str, Any]:
    """Turn `index`: reasoning and a tool call, the last one reasoning and an answer."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": "",
        "reasoning_content": f"Step {index}: the notes may say more about item {index}.",
    }
    if index == TURNS - 1:
        message["content"] = "Items 0 to 8 are all in the notes."
        return message
    arguments = json.dumps({"query": f"item {index}", "limit": index + 1})
    message["tool_calls"] = [
        {
            "id": f"call_{index}",
            "type": "function",
            "function": {"name": "search", "arguments": arguments},
        }
    ]
    return message


def render(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    return str(
        mtt_template.apply_chat_template(
            copy.deepcopy(messages), tokenizer=tokenizer, tools=TOOLS, tokenize=False
        )
    )


def script(tokenizer: Any) -> tuple[list[dict[str, Any]], list[list[dict[str, Any]]]]:
    """The replay script (message, sampled ids and their texts per turn) and each turn's
    request messages."""
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a research helper."},
        {"role": "user", "content": "Which items are in the notes?"},
    ]
    eos = tokenizer.convert_tokens_to_ids(EOS)
    turns, requests = [], []
    for index in range(TURNS):
        reply = assistant_turn(index)
        prompt = render(tokenizer, history)
        full = render(tokenizer, [*history, reply])
        assert full.startswith(prompt)
        ids = tokenizer.encode(full[len(prompt) :], add_special_tokens=False)
        ids = ids[: ids.index(eos) + 1]  # the model stops at its end-of-sentence token
        texts = [tokenizer.decode([i]) for i in ids]
        turns.append({"message": reply, "ids": ids, "texts": texts})
        requests.append(copy.deepcopy(history))
        history.append(reply)
        if "tool_calls" in reply:
            history.append(
                {"role": "tool", "tool_call_id": f"call_{index}", "content": f"item {index}: found"}
            )
    return turns, requests


@pytest.fixture(scope="module", params=sorted(MODEL_TYPES))
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def directory(family: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return deepseek_v4_dir(tmp_path_factory.mktemp(family), model_type=MODEL_TYPES[family])


@pytest.fixture(scope="module")
def gateway(family: str, directory: Path) -> Iterator[tuple[str, str]]:
    port = free_port()
    with ServerProcess(
        ["--port", str(port)],
        port,
        module="support.replay_engine",
        env={"PYTHONPATH": str(TESTS_DIR)},
    ) as engine:
        gateway_port = free_port()
        argv = ["serve", "--port", str(gateway_port), "--backend", engine.url, "--workers", "0"]
        argv += ["--tokenizer", str(directory), "--tito-model", family]
        with ServerProcess(argv, gateway_port, timeout=60) as proc:
            yield proc.url, engine.url


def test_ten_turn_agent_session_is_token_exact(
    family: str, directory: Path, gateway: tuple[str, str]
) -> None:
    gateway_url, engine_url = gateway
    tokenizer = hf_tokenizer(directory)
    turns, requests = script(tokenizer)
    tito = mtt_types.get_tito_tokenizer(tokenizer, family)
    with httpx.Client(timeout=30) as client:
        sid = client.post(gateway_url + "/sessions", json={}).json()["session_id"]
        assert client.post(f"{engine_url}/replay/{sid}", json={"turns": turns}).status_code == 200
        for messages in requests:
            reply = client.post(
                f"{gateway_url}/sessions/{sid}/v1/chat/completions",
                json={"model": "m", "messages": messages, "tools": TOOLS},
            )
            assert reply.status_code == 200, reply.text
        received = client.get(f"{engine_url}/replay/{sid}").json()["prompts"]
        session = client.get(f"{gateway_url}/sessions/{sid}").json()
    assert len(received) == TURNS
    # Turn 1: the framework's full render; every later one its merge_tokens.
    assert received[0] == tokenizer.encode(render(tokenizer, requests[0]), add_special_tokens=False)
    for index in range(1, TURNS):
        expected = tito.merge_tokens(
            copy.deepcopy([*requests[index - 1], turns[index - 1]["message"]]),
            copy.deepcopy(requests[index]),
            received[index - 1] + turns[index - 1]["ids"],
            tools=TOOLS,
        )
        assert received[index] == expected, f"turn {index + 1}"
    records = session["records"]
    assert [r["request"]["input_ids"] for r in records] == received
    outputs = [
        [token[1] for token in r["response"]["choices"][0]["meta_info"]["output_token_logprobs"]]
        for r in records
    ]
    assert outputs == [turn["ids"] for turn in turns]
    assert session["metadata"]["tito_session_mismatch"] == []
    assert session["metadata"]["accumulated_token_ids"] == received[-1] + turns[-1]["ids"]

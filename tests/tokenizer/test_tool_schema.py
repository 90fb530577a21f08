"""Request tools reach the chat template as SGLang 0.5.23 hands them over, not as sent.

Facts, all under `sglang/srt/entrypoints/openai/` in the sglang-0.5.23 wheel:
- protocol.py `Tool` / `Function`: the request's tools are validated into these pydantic
  models. Unknown keys are ignored; `Tool.type` defaults to "function"; a tool-level
  `defer_loading` is copied into a function without one (`_propagate_defer_loading`); the
  function's dump (`_serialize`) keeps `description` and `parameters` (null when absent), drops
  `strict` and `defer_loading` while unset, and orders keys as the client sent them, the
  others after in field order; the tool's dump always has `defer_loading` (null when unset).
  Booleans are coerced as pydantic coerces them; a missing name or a non-string description is
  refused.
- serving_chat.py `_process_messages`: `tools = [item.model_dump() for item in request.tools]`,
  handed to `_apply_jinja_template`, which passes it to the template; no tools (None or an
  empty list) render as None.

A template printing `tools|tojson` shows the difference from the client's JSON.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sessiongate.errors import BadRequest
from sessiongate.session.tito import TitoEngine
from sessiongate.tokenizer import ChatTokenizer, TokenizerError, load_tokenizer
from support.procs import ServerProcess, free_port, mock_engine
from support.tool_templates import tokenizer_dir

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

PRINTS_TOOLS = """\
{%- if tools -%}{{- '<|im_start|>system\\n' + (tools | tojson) + '<|im_end|>\\n' -}}{%- endif -%}
{%- for m in messages -%}
    {{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""

# What a client sends: keys out of order, extra keys, a tool-level defer_loading, a strict
# spelled as a string, a missing type.
CLIENT_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            "name": "weather",
            "x-vendor": 1,
        },
        "cache_control": {"type": "ephemeral"},
    },
    {"function": {"name": "search", "strict": "true", "description": "Find."}},
    {"type": "function", "function": {"name": "later"}, "defer_loading": True},
]
# Their model dump, written out from protocol.py (see the module docstring).
SGLANG_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            "name": "weather",
            "description": None,
        },
        "defer_loading": None,
    },
    {
        "type": "function",
        "function": {"name": "search", "strict": True, "description": "Find.", "parameters": None},
        "defer_loading": None,
    },
    {
        "type": "function",
        "function": {
            "name": "later",
            "description": None,
            "parameters": None,
            "defer_loading": True,
        },
        "defer_loading": True,
    },
]


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tokenizer_dir(tmp_path_factory.mktemp("prints-tools"), PRINTS_TOOLS)


@pytest.fixture(scope="module")
def tok(directory: Path) -> ChatTokenizer:
    return load_tokenizer(directory)


def system_text(tools: list[dict[str, Any]]) -> str:
    return "<|im_start|>system\n" + json.dumps(tools, ensure_ascii=False) + "<|im_end|>\n"


def test_the_template_sees_sglangs_dump_and_the_callers_list_is_unchanged(
    tok: ChatTokenizer,
) -> None:
    sent = copy.deepcopy(CLIENT_TOOLS)
    text = tok.render([{"role": "user", "content": "hi"}], add_generation_prompt=True, tools=sent)
    assert text.startswith(system_text(SGLANG_TOOLS))
    assert not text.startswith(system_text(CLIENT_TOOLS))
    assert sent == CLIENT_TOOLS


def test_every_turn_renders_the_dump(tok: ChatTokenizer) -> None:
    # Turn 1 renders the whole prompt, later turns only what the agent appended (under the
    # same tools); the accumulated ids must equal a full render with SGLang's dump.
    engine = TitoEngine(tok)
    history: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    ids = engine.first_turn_ids(history, CLIENT_TOOLS)
    reply = {"role": "assistant", "content": "hello"}
    ids += tok.encode("hello<|im_end|>")
    appended = [{"role": "user", "content": "more"}]
    ids += engine.junction_ids(ids) + engine.appended_ids(reply, appended, CLIENT_TOOLS)
    history += [reply, *appended]
    assert tok.decode(ids).startswith(system_text(SGLANG_TOOLS))
    assert ids == tok.apply_chat_template(history, add_generation_prompt=True, tools=CLIENT_TOOLS)
    assert engine.mismatches(history, CLIENT_TOOLS, ids[: -len(tok.generation_prompt_ids)]) == []


@pytest.mark.parametrize(
    ("tool", "where"),
    [
        ({"type": "function"}, r"tools\[0\]\.function: Field required"),
        ({"function": {"parameters": {}}}, r"tools\[0\]\.function\.name: Field required"),
        ({"function": {"name": 7}}, r"tools\[0\]\.function\.name: Input should be a valid string"),
        ({"function": {"name": "f", "description": 1}}, r"function\.description"),
        ({"function": {"name": "f", "strict": "maybe"}}, r"function\.strict"),
        ({"type": None, "function": {"name": "f"}}, r"tools\[0\]\.type"),
    ],
)
def test_a_tool_sglang_refuses_is_refused(tok: ChatTokenizer, tool: Any, where: str) -> None:
    with pytest.raises(TokenizerError, match=where):
        tok.render([{"role": "user", "content": "hi"}], add_generation_prompt=True, tools=[tool])
    # Through the TITO engine it is a 400, as SGLang answers a request it cannot validate.
    with pytest.raises(BadRequest, match=where):
        TitoEngine(tok).first_turn_ids([{"role": "user", "content": "hi"}], [tool])


def test_no_tools_render_as_none(tok: ChatTokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    bare = tok.render(messages, add_generation_prompt=True)
    assert tok.render(messages, add_generation_prompt=True, tools=[]) == bare
    assert "system" not in bare


# -- through a real gateway ----------------------------------------------------------------


@pytest.fixture(scope="module")
def gateway(directory: Path) -> Iterator[tuple[httpx.Client, ServerProcess]]:
    with mock_engine("--tokenizer", str(directory)) as engine:
        port = free_port()
        argv = ["serve", "--port", str(port), "--workers", "0", "--backend", engine.url]
        argv += ["--tokenizer", str(directory)]
        with (
            ServerProcess(argv, port, timeout=60) as proc,
            httpx.Client(base_url=proc.url, timeout=30) as client,
        ):
            yield client, engine


def test_gateway_prompts_use_the_dump_and_records_keep_the_clients_tools(
    gateway: tuple[httpx.Client, ServerProcess], tok: ChatTokenizer
) -> None:
    client, engine = gateway
    sid = client.post("/sessions", json={}).json()["session_id"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    for index in range(2):
        body = {"messages": messages, "tools": CLIENT_TOOLS, "max_tokens": 6}
        reply = client.post(f"/sessions/{sid}/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        message = reply.json()["choices"][0]["message"]
        messages += [{"role": "assistant", "content": message["content"] or ""}]
        messages += [{"role": "user", "content": f"next {index}"}]
    session = client.get(f"/sessions/{sid}").json()
    sent = httpx.get(engine.url + "/mock/requests", params={"last": 2}).json()["requests"]
    for record, upstream in zip(session["records"], sent, strict=True):
        assert record["request"]["input_ids"] == upstream["input_ids"]
        assert tok.decode(upstream["input_ids"]).startswith(system_text(SGLANG_TOOLS))
        # The engine gets (for its tool-call parser) and the record keeps the client's tools.
        assert upstream["tools"] == CLIENT_TOOLS
        assert record["request"]["tools"] == CLIENT_TOOLS
    # max_tokens cuts the last turn off before its <|im_end|>: the framework's comparator
    # counts that as special_token_count; the detail leaves out what was never sampled.
    assert session["metadata"]["tito_session_mismatch_detail"] == []

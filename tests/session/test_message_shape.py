"""Messages reach the chat template shaped as SGLang 0.5.23 shapes them.

Each rule is SGLang's, in sglang/srt/entrypoints/openai/serving_chat.py
`OpenAIServingChat._apply_jinja_template` (and the helpers named per test), before it calls
the template; tokenizer/message_shape.py restates them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sessiongate.session.tito import TitoEngine
from sessiongate.tokenizer import ChatTokenizer, TokenizerError, load_tokenizer
from sessiongate.tokenizer.message_shape import sglang_messages
from support.family_templates import family_tokenizer_dir
from support.procs import ServerProcess, free_port, mock_engine

# MiniMax-like: the content printed as given (a null prints "None" unless shaped), arguments
# iterated as a mapping, reasoning printed when the member is there at all.
TEMPLATE = """\
{%- for m in messages -%}
    {%- if m.role == 'assistant' -%}
        {{- ']~b]ai\\n' -}}
        {%- if m.reasoning_content is defined -%}
            {{- '<think>' + m.reasoning_content + '</think>' -}}
        {%- endif -%}
        {{- m.content -}}
        {%- for tc in m.tool_calls or [] -%}
            {{- '<invoke name="' + tc.function.name + '">' -}}
            {%- for k, v in tc.function.arguments.items() -%}
                {{- '<parameter name="' + k + '">' + (v | string) + '</parameter>' -}}
            {%- endfor -%}
            {{- '</invoke>' -}}
        {%- endfor -%}
        {{- '[e~[\\n' -}}
    {%- elif m.role == 'tool' -%}{{- ']~b]tool\\n<response>' + m.content + '</response>[e~[\\n' -}}
    {%- else -%}{{- ']~b]' + m.role + '\\n' + m.content + '[e~[\\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- ']~b]ai\\n' -}}{%- endif -%}
"""

CALL_TEXT = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
}
CALL_OBJECT = {**CALL_TEXT, "function": {"name": "weather", "arguments": {"city": "Paris"}}}
HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL_TEXT]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
]
# What SGLang renders for HISTORY: content "", arguments an object.
SHAPED_TEXT = (
    "]~b]user\nWeather in Paris?[e~[\n"
    ']~b]ai\n<invoke name="weather"><parameter name="city">Paris</parameter></invoke>[e~[\n'
    "]~b]tool\n<response>21 C</response>[e~[\n"
)


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return family_tokenizer_dir(tmp_path_factory.mktemp("shape"), "minimax_m25", template=TEMPLATE)


@pytest.fixture(scope="module")
def tok(directory: Path) -> ChatTokenizer:
    return load_tokenizer(directory)


def render(tok: ChatTokenizer, messages: list[dict[str, Any]]) -> str:
    return tok.render(messages, add_generation_prompt=False)


def test_null_content_renders_as_empty_text(tok: ChatTokenizer) -> None:
    # `_apply_jinja_template`: `if msg_dict.get("content") is None: msg_dict["content"] = ""`
    # (a missing content is None too: the pydantic message defaults it).
    assert render(tok, HISTORY) == SHAPED_TEXT
    assert "None" not in render(tok, [{"role": "assistant", "tool_calls": [CALL_TEXT]}])
    assert HISTORY[1]["content"] is None  # the caller's messages are not changed


def test_tool_call_arguments_as_json_text_or_object_render_alike(tok: ChatTokenizer) -> None:
    # `normalize_assistant_tool_call_arguments` (strict for Jinja templates): a string is
    # parsed with `parse_tool_call_arguments`, an object is left as it is; text that is no
    # JSON object is a 400 (ValueError).
    as_object = [HISTORY[0], {**HISTORY[1], "tool_calls": [CALL_OBJECT]}, HISTORY[2]]
    assert render(tok, as_object) == render(tok, HISTORY) == SHAPED_TEXT
    bad = {**CALL_TEXT, "function": {"name": "weather", "arguments": '["Paris"]'}}
    with pytest.raises(TokenizerError, match="must be a JSON object"):
        render(tok, [{"role": "assistant", "content": None, "tool_calls": [bad]}])


def test_null_members_are_dropped_and_empty_reasoning_is_kept(tok: ChatTokenizer) -> None:
    # sglang/srt/parser/jinja_template_utils.py `process_content_for_template_format` keeps
    # only the members that are not None: `reasoning_content: null` is undefined for the
    # template, `reasoning_content: ""` reaches it as "".
    null = [{"role": "assistant", "content": "ok", "reasoning_content": None}]
    empty = [{"role": "assistant", "content": "ok", "reasoning_content": ""}]
    assert render(tok, null) == "]~b]ai\nok[e~[\n"
    assert render(tok, empty) == "]~b]ai\n<think></think>ok[e~[\n"
    assert sglang_messages(null) == [{"role": "assistant", "content": "ok"}]
    assert sglang_messages(empty) == empty


def test_a_tools_text_parts_are_joined(tok: ChatTokenizer) -> None:
    # serving_chat.py `normalize_tool_content`: a tool message's list of text parts is one
    # string, parts joined by a space; a list with another kind of part is left as it is.
    parts = [{"type": "text", "text": "21"}, {"type": "text", "text": "C"}]
    assert render(tok, [{"role": "tool", "content": parts}]) == (
        "]~b]tool\n<response>21 C</response>[e~[\n"
    )
    image = [*parts, {"type": "image_url", "image_url": {"url": "x"}}]
    assert sglang_messages([{"role": "tool", "content": image}])[0]["content"] == image
    user = [{"role": "user", "content": parts}]
    assert sglang_messages(user) == user  # users' parts go by the template's content format


def test_messages_needing_no_change_are_passed_through() -> None:
    message = {"role": "user", "content": "hi"}
    assert sglang_messages([message])[0] is message


def test_appended_turns_render_the_shaped_history(tok: ChatTokenizer) -> None:
    # A later turn renders only the appended messages after a stub of the last assistant:
    # they must be what a full render of the shaped history gives.
    engine = TitoEngine(tok)
    appended = engine.appended_ids(HISTORY[1], HISTORY[2:], None)
    full = tok.apply_chat_template(HISTORY, add_generation_prompt=True)
    before = tok.apply_chat_template(HISTORY[:2], add_generation_prompt=False)
    assert full == before + appended


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


@pytest.mark.procs
def test_a_session_turn_with_null_content_and_json_text_arguments(
    gateway: tuple[httpx.Client, ServerProcess], tok: ChatTokenizer
) -> None:
    # Through the session core: the prompt sent upstream is SGLang's render of the shaped
    # history, equal to what the mock engine (as SGLang) renders from the same messages; the
    # record keeps the client's messages as sent.
    client, engine = gateway
    sid = client.post("/sessions", json={}).json()["session_id"]
    body = {"messages": HISTORY, "max_tokens": 4}
    reply = client.post(f"/sessions/{sid}/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    (sent,) = httpx.get(engine.url + "/mock/requests", params={"last": 1}).json()["requests"]
    assert tok.decode(sent["input_ids"]) == SHAPED_TEXT + "]~b]ai\n"
    direct = httpx.post(
        engine.url + "/v1/chat/completions",
        json={**body, "return_input_ids_in_sglext": True},
    )
    assert direct.status_code == 200, direct.text
    assert direct.json()["sglext"]["input_ids"] == sent["input_ids"]
    session = client.get(f"/sessions/{sid}").json()
    request = session["records"][0]["request"]
    assert json.loads(json.dumps(request["messages"])) == HISTORY
    assert session["metadata"]["tito_session_mismatch_detail"] == []

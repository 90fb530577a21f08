"""The mock engine renders chat messages shaped as SGLang 0.5.23 shapes them.

Sources, in the sglang-0.5.23 wheel: sglang/srt/entrypoints/openai/serving_chat.py
(`OpenAIServingChat._apply_jinja_template`, `normalize_assistant_tool_call_arguments`,
`normalize_tool_content`) and sglang/srt/parser/jinja_template_utils.py
(`process_content_for_template_format`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sessiongate.tokenizer import ChatTokenizer, load_tokenizer
from support.family_templates import family_tokenizer_dir
from support.procs import ServerProcess, mock_engine

pytestmark = pytest.mark.procs

# Prints each member as given: a null content would print "None", an undefined member nothing.
TEMPLATE = """\
{%- for m in messages -%}
    {{- '<|im_start|>' + m.role + '\\n' -}}
    {%- if m.reasoning_content is defined -%}{{- '<think>' + m.reasoning_content + '</think>' -}}
    {%- endif -%}
    {{- m.content -}}
    {%- for tc in m.tool_calls or [] -%}
        {%- for k, v in tc.function.arguments.items() -%}{{- ' ' + k + '=' + v -}}{%- endfor -%}
    {%- endfor -%}
    {{- '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": "1"}'}}


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return family_tokenizer_dir(tmp_path_factory.mktemp("shape"), "qwen3", template=TEMPLATE)


@pytest.fixture(scope="module")
def engine(directory: Path) -> Iterator[ServerProcess]:
    with mock_engine("--tokenizer", str(directory)) as proc:
        yield proc


@pytest.fixture(scope="module")
def tok(directory: Path) -> ChatTokenizer:
    return load_tokenizer(directory)


@pytest.mark.parametrize(
    ("message", "text"),
    [
        # `_apply_jinja_template`: `content: None` becomes "".
        ({"role": "assistant", "content": None}, "<|im_start|>assistant\n<|im_end|>\n"),
        # `normalize_assistant_tool_call_arguments`: string arguments are parsed.
        (
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            "<|im_start|>assistant\n a=1<|im_end|>\n",
        ),
        # `process_content_for_template_format`: null members dropped, "" kept.
        (
            {"role": "assistant", "content": "x", "reasoning_content": None},
            "<|im_start|>assistant\nx<|im_end|>\n",
        ),
        (
            {"role": "assistant", "content": "x", "reasoning_content": ""},
            "<|im_start|>assistant\n<think></think>x<|im_end|>\n",
        ),
        # `normalize_tool_content`: a tool's text parts joined by a space.
        (
            {
                "role": "tool",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            "<|im_start|>tool\na b<|im_end|>\n",
        ),
    ],
)
def test_the_prompt_is_the_render_of_the_shaped_message(
    engine: ServerProcess, tok: ChatTokenizer, message: dict[str, Any], text: str
) -> None:
    messages = [{"role": "user", "content": "q"}, message]
    body = {"messages": messages, "max_tokens": 1, "return_input_ids_in_sglext": True}
    reply = httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    prompt = tok.decode(reply.json()["sglext"]["input_ids"])
    assert prompt == "<|im_start|>user\nq<|im_end|>\n" + text + "<|im_start|>assistant\n"


def test_arguments_that_are_no_json_object_are_sglangs_400(engine: ServerProcess) -> None:
    # `parse_tool_call_arguments`'s ValueError, a 400 in serving_base.py `handle_request`.
    bad = {**CALL, "function": {"name": "f", "arguments": "[1]"}}
    messages = [{"role": "assistant", "content": None, "tool_calls": [bad]}]
    reply = httpx.post(
        engine.url + "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 1},
        timeout=30,
    )
    assert reply.status_code == 400
    assert (
        reply.json()["message"] == "Assistant tool call function.arguments must be a JSON object."
    )

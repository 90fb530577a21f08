"""A 10-turn agent session per supported `--tito-model` family through a real `serve` process
and the real mock engine: reasoning, tool calls answered with tool results, user turns.

The templates keep each family's layout (role headers, what closes a turn, the switch that
keeps history reasoning, the system message rules; tests/support/family_templates.py describes the
families) but spell an assistant turn the way the mock engine samples it (`<think>`
reasoning `</think>`, content, `<tool_call>` JSON blocks, sessiongate/mock_engine/generate.py),
so a re-render of the history must give back exactly the ids the engine sampled: any
difference is the gateway's. They also print the tools (`tojson`), as SGLang's dump gives them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from sessiongate.demo.verify import completion_ids
from sessiongate.session.tito_families import FAMILIES as TITO_FAMILIES
from support.family_templates import family_tokenizer_dir
from support.procs import ServerProcess, free_port, mock_engine

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

# An assistant turn as the mock samples it; KEEP is the family's rule for history reasoning.
_BODY = (
    "{%- if m.reasoning_content is string and (KEEP) -%}"
    "{{- '<think>' + m.reasoning_content + '</think>' -}}{%- endif -%}"
    "{{- m.content or '' -}}"
    "{%- for tc in m.tool_calls or [] -%}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + tc.function.name + \'", "arguments": \' + '
    "(tc.function.arguments | tojson) + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
)
_LAST_USER = (
    "{%- set ns = namespace(last_user=-1) -%}{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
)
_KEEP_AFTER_LAST_USER = "loop.index0 > ns.last_user or not (SWITCH | default(true))"

CHATML = (
    _LAST_USER + "{%- if tools -%}{{- '<|im_start|>system\\n# Tools\\n' -}}"
    "{%- for t in tools -%}{{- (t | tojson) + '\\n' -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}{{- '<|im_start|>assistant\\n' -}}"
    + _BODY.replace("KEEP", _KEEP_AFTER_LAST_USER)
    + "{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content -}}"
    "{{- '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
QWEN35 = (
    "{%- for m in messages -%}{%- if m.role == 'system' and not loop.first -%}"
    "{{- raise_exception('System message must be at the beginning.') -}}"
    "{%- endif -%}{%- endfor -%}" + CHATML
)

KIMI = (
    "{%- set ns = namespace(last_plain=-1) -%}"
    "{%- if not (preserve_thinking | default(false)) -%}{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and not m.tool_calls -%}{%- set ns.last_plain = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- if tools -%}{{- '<|im_system|>tool_declare<|im_middle|>' + (tools | tojson) -}}"
    "{{- '<|im_end|>' -}}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}{{- '<|im_assistant|>assistant<|im_middle|>' -}}"
    + _BODY.replace("KEEP", "loop.index0 > ns.last_plain")
    + "{%- elif m.role == 'user' -%}{{- '<|im_user|>user<|im_middle|>' + m.content -}}"
    "{%- elif m.role == 'tool' -%}"
    "{{- '<|im_system|>tool<|im_middle|>## Return of ' + m.tool_call_id + '\\n' + m.content -}}"
    "{%- else -%}{{- '<|im_system|>' + m.role + '<|im_middle|>' + m.content -}}"
    "{%- endif -%}{{- '<|im_end|>' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_assistant|>assistant<|im_middle|>' -}}{%- endif -%}"
)

MINIMAX = (
    _LAST_USER + "{{- ']~!b[]~b]system\\n' -}}"
    "{%- if messages and messages[0].role == 'system' -%}{{- messages[0].content -}}{%- endif -%}"
    "{%- if tools -%}{{- '\\n<tools>' -}}{%- for t in tools -%}{{- '\\n' + (t | tojson) -}}"
    "{%- endfor -%}{{- '\\n</tools>' -}}{%- endif -%}"
    "{{- '[e~[\\n' -}}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}{{- ']~b]ai\\n' -}}"
    + _BODY.replace("KEEP", _KEEP_AFTER_LAST_USER)
    + "{{- '[e~[\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{{- ']~b]tool\\n<response>' + m.content + '</response>[e~[\\n' -}}"
    "{%- elif m.role == 'user' -%}{{- ']~b]user\\n' + m.content + '[e~[\\n' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- ']~b]ai\\n' -}}{%- endif -%}"
)

GLM47 = (
    _LAST_USER + "{{- '[gMASK]<sop>' -}}"
    "{%- if tools -%}{{- '<|system|>\\n# Tools\\n' -}}"
    "{%- for t in tools -%}{{- (t | tojson) + '\\n' -}}{%- endfor -%}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}{{- '<|assistant|>' -}}"
    + _BODY.replace("KEEP", _KEEP_AFTER_LAST_USER)
    + "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}"
    "{{- '<|observation|>' -}}{%- endif -%}"
    "{{- '<tool_response>' + m.content + '</tool_response>' -}}"
    "{%- else -%}{{- '<|' + m.role + '|>' + m.content -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)

INKLING = (
    "{%- set effort = '<|message_system|><|content_text|>Effort 0.9<|end_message|>' -%}"
    "{%- if tools -%}{{- '<|message_system|>tool_declare<|content_xml|>' + (tools | tojson) -}}"
    "{{- '<|end_message|>' -}}{%- endif -%}"
    "{%- set st = namespace(effort=false) -%}"
    "{%- for m in messages -%}"
    "{%- if m.role != 'system' and not st.effort -%}{{- effort -}}{%- set st.effort = true -%}"
    "{%- endif -%}"
    "{%- if m.role == 'assistant' -%}{{- '<|message_model|>' -}}"
    + _BODY.replace("KEEP", "true")
    + "{{- '<|content_model_end_sampling|>' -}}"
    "{%- elif m.role == 'tool' -%}{%- set found = namespace(name='') -%}"
    "{%- for p in messages if p.role == 'assistant' -%}"
    "{%- for tc in p.tool_calls or [] if tc.id == m.tool_call_id -%}"
    "{%- set found.name = tc.function.name -%}{%- endfor -%}{%- endfor -%}"
    "{{- '<|message_tool|>' + found.name + '<|content_text|>' + m.content + '<|end_message|>' -}}"
    "{%- else -%}"
    "{{- '<|message_' + m.role + '|><|content_text|>' + m.content + '<|end_message|>' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if not st.effort -%}{{- effort -}}{%- endif -%}"
    "{%- if add_generation_prompt -%}{{- '<|message_model|>' -}}{%- endif -%}"
)

# Family -> (template, end-of-sequence token when not the family test tokenizer's).
AGENT_TEMPLATES: dict[str, tuple[str, str | None]] = {
    "qwen3": (CHATML.replace("SWITCH", "clear_thinking"), None),
    "qwennext": (CHATML.replace("SWITCH", "clear_thinking"), None),
    "qwen35": (QWEN35.replace("SWITCH", "clear_thinking"), None),
    "nemotron3": (CHATML.replace("SWITCH", "truncate_history_thinking"), None),
    "kimi25": (KIMI, None),
    "kimi26": (KIMI, None),
    "minimax_m25": (MINIMAX.replace("SWITCH", "clear_thinking"), None),
    "minimax_m27": (MINIMAX.replace("SWITCH", "clear_thinking"), None),
    # The mock stops at its tokenizer's one end token; GLM 4.7 stops at <|user|> or
    # <|observation|>. Ending every turn with <|user|> also covers a tool result after it
    # (the stop token differs from the next message's opener).
    "glm47": (GLM47.replace("SWITCH", "clear_thinking"), "<|user|>"),
    # An assistant turn is one block here (the mock samples one text); the turn still ends
    # at <|content_model_end_sampling|> and every other message with <|end_message|>.
    "inkling": (INKLING, None),
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TURNS = 10


def test_every_supported_family_has_an_agent_session() -> None:
    # DeepSeek's families: tests/peer/test_deepseek_sessions.py (their encoders, real vocabulary).
    assert set(TITO_FAMILIES) - {"default", "deepseekv32", "deepseekv4"} == set(AGENT_TEMPLATES)


@pytest.mark.parametrize("name", sorted(AGENT_TEMPLATES))
def test_ten_turn_agent_session_is_token_exact(tmp_path: Path, name: str) -> None:
    template, eos = AGENT_TEMPLATES[name]
    directory = family_tokenizer_dir(tmp_path / name, name, template=template, eos=eos)
    engine_args = ["--tokenizer", str(directory), "--reasoning-parser", "qwen3"]
    engine_args += ["--tool-call-rate", "0.5", "--completion-tokens", "24"]
    with mock_engine(*engine_args) as engine:
        port = free_port()
        argv = ["serve", "--port", str(port), "--workers", "0", "--backend", engine.url]
        argv += ["--tokenizer", str(directory), "--tito-model", name]
        # The test's template, not the family's fixed one (it spells turns as the mock does).
        argv += ["--chat-template-path", str(directory / "chat_template.jinja")]
        with (
            ServerProcess(argv, port, timeout=60) as proc,
            httpx.Client(base_url=proc.url, timeout=30) as client,
        ):
            sid = client.post("/sessions", json={}).json()["session_id"]
            session, calls = run_agent(client, sid)
        sent = httpx.get(engine.url + "/mock/requests", params={"last": TURNS}).json()
    assert 0 < calls < TURNS  # both tool calls and plain answers
    assert session["metadata"]["tito_session_mismatch"] == []
    records = session["records"]
    assert len(records) == TURNS
    # Token-exact: every prompt is what the engine received, each one extends the previous
    # prompt and sampled ids (less a trailing stop token the next message opens itself with,
    # GLM 4.7's), and the record's ids are the engine's prompt and output ids.
    trim = TITO_FAMILIES[name].max_trim_tokens
    accumulated: list[int] = []
    for record, upstream in zip(records, sent["requests"], strict=True):
        prompt = record["request"]["input_ids"]
        assert prompt == upstream["input_ids"]
        kept = accumulated[: len(accumulated) - trim] if trim else accumulated
        assert prompt[: len(kept)] == kept
        output = completion_ids(record["response"])
        meta = record["response"]["choices"][0]["meta_info"]
        assert output == [token[1] for token in meta["output_token_logprobs"]]
        accumulated = prompt + output
    assert session["metadata"]["accumulated_token_ids"] == accumulated


def run_agent(client: httpx.Client, sid: str) -> tuple[dict[str, Any], int]:
    """TURNS turns: a tool call is answered with its result, an answer with a user turn."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helper."},
        {"role": "user", "content": "Weather in Paris?"},
    ]
    calls = 0
    for index in range(TURNS):
        body = {"messages": messages, "tools": TOOLS, "max_tokens": 64}
        reply = client.post(f"/sessions/{sid}/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        message = reply.json()["choices"][0]["message"]
        assert message.get("reasoning_content")
        messages.append({k: v for k, v in message.items() if v is not None})
        if message.get("tool_calls"):
            calls += 1
            for call in message["tool_calls"]:
                result = f"{index * 3 + 1} C"
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        else:
            messages.append({"role": "user", "content": f"And tomorrow, day {index}?"})
    session: dict[str, Any] = client.get(f"/sessions/{sid}").json()
    return session, calls

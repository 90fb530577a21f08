"""Small chat templates in the style of model families that read tool-call arguments as a
mapping, written over the built-in tokenizer's ChatML tokens so tests need no model files.

- QWEN35_STYLE follows Qwen3.5's template: XML-ish ``<function=name>`` blocks with one
  ``<parameter=key>`` per argument, from ``tool_call.arguments|items`` (the jinja filter,
  which raises on a string).
- MINIMAX_STYLE follows MiniMax M2's: ``<invoke name=...>`` with
  ``<parameter name=...>`` per argument, from ``_args.items()`` (a method call, undefined
  on a string).

Both render tool results the way their families do and stay append-only, which TITO needs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from sessiongate.tokenizer import BUILTIN_TOKENIZER_DIR

QWEN35_STYLE = """\
{%- for message in messages %}
    {%- if message.role == "assistant" %}
        {{- '<|im_start|>assistant\\n' + (message.content or '') }}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}
            {%- for args_name, args_value in tool_call.arguments|items %}
                {{- '<parameter=' + args_name + '>\\n' }}
                {%- set args_value = args_value | tojson | safe if args_value is mapping or \
(args_value is sequence and args_value is not string) else args_value | string %}
                {{- args_value }}
                {{- '\\n</parameter>\\n' }}
            {%- endfor %}
            {{- '</function>\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.previtem and loop.previtem.role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != "tool" %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

MINIMAX_STYLE = """\
{%- for message in messages -%}
    {%- if message.role == 'assistant' -%}
        {{- '<|im_start|>ai\\n' }}
        {%- if message.content -%}{{- message.content }}{%- endif -%}
        {%- if message.tool_calls -%}
            {{- '\\n<tool_call>\\n' }}
            {%- for tool_call in message.tool_calls -%}
                {%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
                {{- '<invoke name="' + tool_call.name + '">' }}
                {%- set _args = tool_call.arguments %}
                {%- for k, v in _args.items() %}
                    {{- '<parameter name="' + k + '">' }}
                    {{- v | tojson(ensure_ascii=False) if v is not string else v }}
                    {{- '</parameter>' }}
                {%- endfor %}
                {{- '</invoke>\\n' }}
            {%- endfor -%}
            {{- '</tool_call>' }}
        {%- endif -%}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' -%}
        {{- '<|im_start|>tool\\n<response>' + message.content + '</response><|im_end|>\\n' }}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>ai\\n' }}
{%- endif -%}
"""

TEMPLATES = {"qwen3.5-style": QWEN35_STYLE, "minimax-style": MINIMAX_STYLE}


def tokenizer_dir(path: Path, template: str) -> Path:
    """A Hugging Face tokenizer directory: the built-in vocabulary under `template`."""
    path.mkdir(parents=True, exist_ok=True)
    shutil.copy(BUILTIN_TOKENIZER_DIR / "tokenizer.json", path / "tokenizer.json")
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (path / "chat_template.jinja").write_text(template, encoding="utf-8")
    return path

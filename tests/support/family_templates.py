"""Small chat templates in the style of the model families `--tito-model` names, over the
built-in vocabulary plus each family's role tokens (added as special tokens, as the real
tokenizers flag them), so tests need no model files.

Each keeps the trait that makes its family need pinned template variables:

- QWEN3_STYLE: ChatML; an assistant's reasoning is rendered only after the last user message
  unless `clear_thinking` is false (the Qwen families; Nemotron 3 with
  `truncate_history_thinking`; Qwen3.5 also refuses a system message after the first).
- KIMI_STYLE: `<|im_assistant|>assistant<|im_middle|>` headers, no newline after
  `<|im_end|>`; reasoning up to the last assistant without tool calls is emptied unless
  `preserve_thinking` is true (Kimi K2.5/K2.6).
- MINIMAX_STYLE: `]~b]ai` / `]~b]user` / `]~b]tool` headers closed by `[e~[` and a newline;
  reasoning only after the last user unless `clear_thinking` is false, and only a leading
  system message is rendered (MiniMax M2.5/M2.7).
- GLM47_STYLE: `[gMASK]<sop>`, then each message opened by its role token (`<|system|>`,
  `<|user|>`, `<|assistant|>`, one `<|observation|>` before a run of tool results) and closed
  by nothing: the model stops at `<|user|>` or `<|observation|>`, which the next message
  renders itself. Tool calls are `<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>
  </tool_call>`; the generation prompt opens the reasoning (`<think>`), and a history
  assistant keeps its reasoning only after the last user unless `clear_thinking` is false
  (it is then `</think>` alone) (GLM 4.7).
- INKLING_STYLE: every block is a role token, a content kind token, the text and
  `<|end_message|>`; an assistant turn is up to three kinds of blocks (thinking, text, one per
  tool call as JSON) closed by `<|content_model_end_sampling|>`, where the model stops, and by
  nothing when it has no block. A thinking-effort system block precedes the first message
  that is not a system one; a tool result is named after the call its id answers (Inkling,
  as the rollout framework's fixed template renders it).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

from sessiongate.tokenizer import BUILTIN_TOKENIZER_DIR

QWEN3_STYLE = """\
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}\
{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
    {%- if m.role == 'assistant' -%}
        {{- '<|im_start|>assistant\\n' -}}
        {%- if m.reasoning_content and (loop.index0 > ns.last_user or \
not (clear_thinking | default(true))) -%}
            {{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' -}}
        {%- endif -%}
        {{- m.content or '' -}}
        {%- for tc in m.tool_calls or [] -%}
            {{- '\\n<tool_call>\\n{"name": "' + tc.function.name + '", "arguments": ' + \
(tc.function.arguments | tojson) + '}\\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\\n' -}}
    {%- elif m.role == 'tool' -%}
        {{- '<|im_start|>user\\n<tool_response>\\n' + m.content -}}
        {{- '\\n</tool_response><|im_end|>\\n' -}}
    {%- else -%}
        {{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""

KIMI_STYLE = """\
{%- set ns = namespace(last_plain=-1) -%}
{%- if not (preserve_thinking | default(false)) -%}
    {%- for m in messages -%}
        {%- if m.role == 'assistant' and not m.tool_calls -%}
            {%- set ns.last_plain = loop.index0 -%}
        {%- endif -%}
    {%- endfor -%}
{%- endif -%}
{%- for m in messages -%}
    {%- if m.role == 'user' -%}{{- '<|im_user|>user<|im_middle|>' -}}
    {%- elif m.role == 'assistant' -%}{{- '<|im_assistant|>assistant<|im_middle|>' -}}
    {%- else -%}{{- '<|im_system|>' + m.role + '<|im_middle|>' -}}
    {%- endif -%}
    {%- if m.role == 'assistant' -%}
        {%- if loop.index0 <= ns.last_plain -%}{{- '<think></think>' -}}
        {%- else -%}{{- '<think>' + (m.reasoning_content or '') + '</think>' -}}
        {%- endif -%}
        {{- m.content or '' -}}
        {%- if m.tool_calls -%}
            {{- '<|tool_calls_section_begin|>' -}}
            {%- for tc in m.tool_calls -%}
                {{- '<|tool_call_begin|>' + tc.id + '<|tool_call_argument_begin|>' + \
(tc.function.arguments | tojson) + '<|tool_call_end|>' -}}
            {%- endfor -%}
            {{- '<|tool_calls_section_end|>' -}}
        {%- endif -%}
    {%- elif m.role == 'tool' -%}
        {{- '## Return of ' + m.tool_call_id + '\\n' + m.content -}}
    {%- else -%}{{- m.content -}}
    {%- endif -%}
    {{- '<|im_end|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_assistant|>assistant<|im_middle|><think>' -}}{%- endif -%}
"""

MINIMAX_STYLE = """\
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}\
{%- endif -%}{%- endfor -%}
{{- ']~!b[]~b]system\\n' -}}
{%- if messages and messages[0].role == 'system' -%}{{- messages[0].content -}}{%- endif -%}
{{- '[e~[\\n' -}}
{%- for m in messages -%}
    {%- if m.role == 'assistant' -%}
        {{- ']~b]ai\\n' -}}
        {%- if m.reasoning_content and (loop.index0 > ns.last_user or \
not (clear_thinking | default(true))) -%}
            {{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' -}}
        {%- endif -%}
        {{- m.content or '' -}}
        {%- if m.tool_calls -%}
            {{- '\\n<minimax:tool_call>\\n' -}}
            {%- for tc in m.tool_calls -%}
                {{- '<invoke name="' + tc.function.name + '">' -}}
                {%- for k, v in tc.function.arguments.items() -%}
                    {{- '<parameter name="' + k + '">' + (v | string) + '</parameter>' -}}
                {%- endfor -%}
                {{- '</invoke>\\n' -}}
            {%- endfor -%}
            {{- '</minimax:tool_call>' -}}
        {%- endif -%}
        {{- '[e~[\\n' -}}
    {%- elif m.role == 'tool' -%}
        {{- ']~b]tool\\n<response>' + m.content + '</response>[e~[\\n' -}}
    {%- elif m.role == 'user' -%}
        {{- ']~b]user\\n' + m.content + '[e~[\\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- ']~b]ai\\n<think>\\n' -}}{%- endif -%}
"""

GLM47_STYLE = """\
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}\
{%- endif -%}{%- endfor -%}
{{- '[gMASK]<sop>' -}}
{%- for m in messages -%}
    {%- if m.role == 'assistant' -%}
        {{- '<|assistant|>' -}}
        {%- if m.reasoning_content and (loop.index0 > ns.last_user or \
not (clear_thinking | default(true))) -%}
            {{- '<think>' + m.reasoning_content.strip() + '</think>' -}}
        {%- else -%}{{- '</think>' -}}
        {%- endif -%}
        {{- (m.content or '').strip() -}}
        {%- for tc in m.tool_calls or [] -%}
            {{- '<tool_call>' + tc.function.name -}}
            {%- for k, v in tc.function.arguments.items() -%}
                {{- '<arg_key>' + k + '</arg_key><arg_value>' -}}
                {{- v if v is string else (v | tojson) -}}{{- '</arg_value>' -}}
            {%- endfor -%}
            {{- '</tool_call>' -}}
        {%- endfor -%}
    {%- elif m.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
            {{- '<|observation|>' -}}
        {%- endif -%}
        {{- '<tool_response>' + m.content + '</tool_response>' -}}
    {%- else -%}{{- '<|' + m.role + '|>' + m.content -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|assistant|><think>' -}}{%- endif -%}
"""

INKLING_STYLE = """\
{%- set roles = {'user': '<|message_user|>', 'assistant': '<|message_model|>', \
'system': '<|message_system|>', 'tool': '<|message_tool|>'} -%}
{%- set effort = '<|message_system|><|content_text|>Thinking effort level: 0.9<|end_message|>' -%}
{%- if tools -%}
    {{- '<|message_system|>tool_declare<|content_xml|>' + (tools | tojson) + '<|end_message|>' -}}
{%- endif -%}
{%- set st = namespace(effort=false) -%}
{%- for m in messages -%}
    {%- if m.role != 'system' and not st.effort -%}{{- effort -}}{%- set st.effort = true -%}
    {%- endif -%}
    {%- if m.role == 'tool' -%}
        {%- set found = namespace(name='') -%}
        {%- for p in messages if p.role == 'assistant' -%}
            {%- for tc in p.tool_calls or [] if tc.id == m.tool_call_id -%}
                {%- set found.name = tc.function.name -%}
            {%- endfor -%}
        {%- endfor -%}
        {{- '<|message_tool|>' + found.name + '<|content_text|>' + m.content + '<|end_message|>' -}}
    {%- elif m.role == 'assistant' -%}
        {%- if m.reasoning_content -%}
            {{- '<|message_model|><|content_thinking|>' -}}
            {{- m.reasoning_content + '<|end_message|>' -}}
        {%- endif -%}
        {%- if m.content -%}
            {{- '<|message_model|><|content_text|>' + m.content + '<|end_message|>' -}}
        {%- endif -%}
        {%- for tc in m.tool_calls or [] -%}
            {{- '<|message_model|>' + tc.function.name + '<|content_invoke_tool_json|>' -}}
            {{- {'name': tc.function.name, 'args': tc.function.arguments} | tojson -}}
            {{- '<|end_message|>' -}}
        {%- endfor -%}
        {%- if m.reasoning_content or m.content or m.tool_calls -%}
            {{- '<|content_model_end_sampling|>' -}}
        {%- endif -%}
    {%- else -%}{{- roles[m.role] + '<|content_text|>' + m.content + '<|end_message|>' -}}
    {%- endif -%}
{%- endfor -%}
{%- if not st.effort -%}{{- effort -}}{%- endif -%}
{%- if add_generation_prompt -%}{{- '<|message_model|>' -}}{%- endif -%}
"""

# Qwen3.5 refuses a system message after the first; Nemotron 3 keeps history reasoning
# under its own switch.
QWEN35_STYLE = (
    "{%- for m in messages -%}{%- if m.role == 'system' and not loop.first -%}"
    "{{- raise_exception('System message must be at the beginning.') -}}"
    "{%- endif -%}{%- endfor -%}\n" + QWEN3_STYLE
)
NEMOTRON3_STYLE = QWEN3_STYLE.replace("clear_thinking", "truncate_history_thinking")

KIMI_TOKENS = (
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)
MINIMAX_TOKENS = ("]~!b[", "]~b]", "[e~[")
INKLING_TOKENS = (
    "<|message_user|>",
    "<|message_model|>",
    "<|message_system|>",
    "<|message_tool|>",
    "<|content_text|>",
    "<|content_thinking|>",
    "<|content_invoke_tool_json|>",
    "<|content_xml|>",
    "<|end_message|>",
    "<|content_model_end_sampling|>",
)
GLM_TOKENS = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")

# Family name (as --tito-model takes it) -> (template, its role tokens, end-of-sequence token).
FAMILIES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "qwen3": (QWEN3_STYLE, (), "<|im_end|>"),
    "qwennext": (QWEN3_STYLE, (), "<|im_end|>"),
    "qwen35": (QWEN35_STYLE, (), "<|im_end|>"),
    "nemotron3": (NEMOTRON3_STYLE, (), "<|im_end|>"),
    "kimi25": (KIMI_STYLE, KIMI_TOKENS, "<|im_end|>"),
    "kimi26": (KIMI_STYLE, KIMI_TOKENS, "<|im_end|>"),
    "minimax_m25": (MINIMAX_STYLE, MINIMAX_TOKENS, "[e~["),
    "minimax_m27": (MINIMAX_STYLE, MINIMAX_TOKENS, "[e~["),
    "glm47": (GLM47_STYLE, GLM_TOKENS, "<|endoftext|>"),
    "inkling": (INKLING_STYLE, INKLING_TOKENS, "<|endoftext|>"),
}


def family_tokenizer_dir(
    path: Path, family: str, *, template: str | None = None, eos: str | None = None
) -> Path:
    """A Hugging Face tokenizer directory: the built-in vocabulary, `family`'s role tokens
    added as special tokens, and `family`'s template (or `template`, and `eos` for its
    end-of-sequence token)."""
    family_template, role_tokens, family_eos = FAMILIES[family]
    template = template or family_template
    eos = eos or family_eos
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(BUILTIN_TOKENIZER_DIR / "tokenizer.json"))
    if role_tokens:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in role_tokens])
    tok.save(str(path / "tokenizer.json"))
    config = {"eos_token": eos, "pad_token": "<|endoftext|>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (path / "chat_template.jinja").write_text(template, encoding="utf-8")
    return path

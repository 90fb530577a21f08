"""Messages as SGLang hands them to a Jinja chat template.

SGLang 0.5.23 does not render a request's messages as sent. Before the template sees them,
`_apply_jinja_template` in sglang/srt/entrypoints/openai/serving_chat.py:

1. parses every assistant tool call's string ``function.arguments`` into the object it
   denotes (`normalize_assistant_tool_call_arguments`, strict: text that is not a JSON
   object is a 400); arguments given as an object are left as they are;
2. turns ``content: null`` (and a missing ``content``: the pydantic message defaults it to
   None) into ``""``;
3. drops every other member whose value is null (`process_content_for_template_format` in
   sglang/srt/parser/jinja_template_utils.py keeps ``v is not None`` only), so a template's
   ``message.reasoning_content is defined`` is false for ``reasoning_content: null``, while
   an empty ``reasoning_content: ""`` is kept and reaches the template as ``""``;
4. joins a tool message's content given as text parts into one string, parts separated by a
   space (`normalize_tool_content`).

Older releases declare fewer message members and roles (sglang_rules.py): pydantic drops a
member its model does not declare (0.5.16 to 0.5.22 drop ``prefix``, 0.5.16 to 0.5.19
``phase`` too), and a role it does not know is refused (``root`` before 0.5.23).

`sglang_messages` applies those rules for the release it is given, so the gateway's renders
(prompts, appended turns, the mismatch re-render) and the mock engine's prompts are the text
that SGLang would render. The input is never mutated; messages that need no change are
passed through as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sessiongate.sglang_rules import NEWEST, SglangRules
from sessiongate.tokenizer.template import TokenizerError
from sessiongate.tokenizer.tool_arguments import template_messages

__all__ = ["sglang_messages"]


def sglang_messages(messages: Sequence[Any], rules: SglangRules = NEWEST) -> list[Any]:
    """`messages` shaped as SGLang (of `rules`) renders them (this module's docstring).

    ToolArgumentsError (a TokenizerError) for string arguments that are not a JSON object,
    as SGLang refuses such a history; TokenizerError for a role that release refuses.
    """
    shaped = template_messages(messages)
    for index, message in enumerate(shaped):
        if isinstance(message, dict):
            role = message.get("role")
            if isinstance(role, str) and role.lower() in rules.refused_roles:
                raise TokenizerError(
                    f"messages[{index}]: role {role!r} is not accepted under {rules.label}"
                )
            new = _shape(message, rules.undeclared_message_members)
            if new is not message:
                shaped[index] = new
    return shaped


def _shape(message: dict[str, Any], undeclared: frozenset[str]) -> dict[str, Any]:
    content = message.get("content")
    tool_text = _tool_text(message.get("role"), content)
    if (
        content is not None
        and tool_text is None
        and None not in message.values()
        and not (undeclared and undeclared.intersection(message))
    ):
        return message  # the common case: nothing to change, no copy
    shaped = {k: v for k, v in message.items() if v is not None and k not in undeclared}
    if tool_text is not None:
        shaped["content"] = tool_text
    elif content is None:
        shaped["content"] = ""
    return shaped


def _tool_text(role: object, content: object) -> str | None:
    # serving_chat.py `normalize_tool_content`: only a list made of text parts is flattened;
    # a list with another kind of part (an image) is left for templates that iterate it.
    if role != "tool" or not isinstance(content, list):
        return None
    if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return None
    return " ".join(str(p.get("text", "")) for p in content)

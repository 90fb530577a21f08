"""Tool-call arguments as chat templates see them: parsed objects, never JSON text.

OpenAI's wire format carries an assistant tool call's ``function.arguments`` as a JSON
string, and that string is what the engine returns and what sessions record. Chat templates
of current model families iterate the arguments as a mapping (Qwen3.5's
``arguments|items``, MiniMax's ``arguments.items()``), so SGLang parses the string into an
object before it renders (``normalize_assistant_tool_call_arguments`` in
sglang/srt/entrypoints/openai/serving_chat.py, strict for Jinja templates), and so does the
rollout framework's ``normalize_tool_arguments(messages, "dict")``. Templates that also accept
a string (``arguments is string``) then take their ``tojson`` branch, as under SGLang.

`template_messages` does that parse on copies, so callers' messages (and records) keep the
exact text the engine sent.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sessiongate.tokenizer.template import TokenizerError

__all__ = [
    "INVALID_JSON",
    "NOT_AN_OBJECT",
    "ToolArgumentsError",
    "parse_tool_arguments",
    "template_messages",
]

# SGLang's messages (serving_chat.py `parse_tool_call_arguments`), word for word: the mock
# engine answers them as SGLang does, and the gateway's 400 names them after the location.
INVALID_JSON = "Assistant tool call function.arguments must be valid JSON."
NOT_AN_OBJECT = "Assistant tool call function.arguments must be a JSON object."


class ToolArgumentsError(TokenizerError):
    """Tool-call arguments that are not JSON text of an object. `reason` is SGLang's own
    message, without the location this error's text adds."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def _no_constant(text: str) -> Any:
    # orjson, which SGLang parses with, refuses NaN and Infinity (not JSON); json accepts them.
    raise ValueError(f"{text} is not JSON")


def parse_tool_arguments(arguments: str) -> dict[str, Any]:
    """`arguments` (JSON text) as the object it denotes; ToolArgumentsError with SGLang's
    message when it is not valid JSON or not an object."""
    try:
        parsed = json.loads(arguments, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested past the limit
        raise ToolArgumentsError(INVALID_JSON, INVALID_JSON) from exc
    if not isinstance(parsed, dict):
        raise ToolArgumentsError(NOT_AN_OBJECT, NOT_AN_OBJECT)
    return parsed


def template_messages(messages: Sequence[Any]) -> list[Any]:
    """`messages` with every assistant tool call's string ``arguments`` parsed into an object.

    Only the messages, calls and function objects that change are copied (most messages are
    passed through as they are); the input is never mutated. Arguments that are objects
    already, or absent, are left alone; a string that is not a JSON object raises
    ToolArgumentsError naming where it is, as SGLang refuses such a history with a 400.
    """
    result = list(messages)
    for index, message in enumerate(result):
        if not isinstance(message, dict) or message.get("role") != "assistant":
            continue
        calls = message.get("tool_calls")
        if not isinstance(calls, list):
            continue
        new_calls: list[Any] | None = None
        for call_index, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
                continue
            try:
                parsed = parse_tool_arguments(function["arguments"])
            except ToolArgumentsError as exc:
                where = f"messages[{index}].tool_calls[{call_index}].function.arguments"
                raise ToolArgumentsError(f"{where}: {exc.reason}", exc.reason) from exc
            if new_calls is None:
                new_calls = list(calls)
            new_calls[call_index] = {**call, "function": {**function, "arguments": parsed}}
        if new_calls is not None:
            result[index] = {**message, "tool_calls": new_calls}
    return result

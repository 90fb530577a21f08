"""Prompt encoders: model families whose prompt is built by Python code, not a Jinja template.

DeepSeek V3.2 and V4 ship no chat template; SGLang and the rollout framework build their
prompt text with DeepSeek's own encoders (the framework's TITO package vendors them from
SGLang: tokenizer/framework_tito.py). A `PromptEncoder` stands where a compiled template
stands in `ChatTokenizer`, so every render the gateway does (first turns, appended turns, the
mismatch re-render) and the mock engine's own renders go through the same code.

What the encoders are handed is what the framework hands them (its `apply_chat_template`):
the messages shaped as for a template (tokenizer/message_shape.py: `content: null` is "", null
members dropped) but tool-call arguments as JSON text (the encoders parse them again into
DSML parameters, so the text's spacing does not reach the prompt), the tools as SGLang dumps
them (the encoders keep each function's name, description and parameters), and the chat
template variables the encoders know (`thinking_mode`, `enable_thinking`, `drop_thinking`,
`reasoning_effort`, `context`, `add_default_bos_token`; any other is a 400, as there).

The encoders have no generation-prompt switch: a conversation that ends with a user or tool
message always ends with the assistant's opener (`<|Assistant|><think>` in thinking mode,
the bars being U+FF5C), and one that ends with an assistant message with its
end-of-sentence token.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from sessiongate.tokenizer.framework_tito import encoder_module
from sessiongate.tokenizer.template import TokenizerError

__all__ = ["ENCODERS", "PromptEncoder", "encoder_for_model_type"]

# Encoder name -> the `model_type` of the checkpoints it renders (config.json), as SGLang and
# the framework's package recognise them.
ENCODERS: Mapping[str, str] = {"deepseek_v32": "deepseek_v32", "deepseek_v4": "deepseek_v4"}


def encoder_for_model_type(model_type: object) -> str | None:
    """The encoder a checkpoint of `model_type` is rendered with, or None (a Jinja template)."""
    return next((name for name, kind in ENCODERS.items() if kind == model_type), None)


class PromptEncoder:
    """One DeepSeek encoder, rendering as `ChatTokenizer.render` asks. Stateless and
    thread-safe: the encoders copy what they change."""

    deterministic = True

    def __init__(self, name: str) -> None:
        if name not in ENCODERS:
            raise TokenizerError(f"unknown prompt encoder {name!r} (known: {', '.join(ENCODERS)})")
        self.name = name
        self._render = encoder_module(name).render_messages

    @property
    def source(self) -> str:
        return f"{self.name} prompt encoder (miles-tito-tokenizers)"

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        kwargs: Mapping[str, Any],
    ) -> str:
        """The prompt text of `messages` (already shaped for a template) under `kwargs`."""
        try:
            return str(self._render(_arguments_as_text(messages), tools=tools, **kwargs))
        except TokenizerError:
            raise
        except Exception as exc:  # the encoders raise ValueError, KeyError, TypeError alike
            raise TokenizerError(f"the {self.name} prompt encoder failed: {exc}") from exc


def _arguments_as_text(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    # The encoders `json.loads` each call's arguments; an object there would be taken as one
    # argument called "arguments".
    shaped = list(messages)
    for index, message in enumerate(shaped):
        calls = message.get("tool_calls")
        if not isinstance(calls, list):
            continue
        new_calls = []
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), dict):
                arguments = json.dumps(function["arguments"], ensure_ascii=False)
                call = {**call, "function": {**function, "arguments": arguments}}
            new_calls.append(call)
        shaped[index] = {**message, "tool_calls": new_calls}
    return shaped

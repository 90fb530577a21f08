"""Request tools as SGLang hands them to the chat template, not as the client sent them.

SGLang validates a request's ``tools`` into its pydantic ``Tool`` / ``Function`` models
(sglang/srt/entrypoints/openai/protocol.py) and renders the template with each tool's
``model_dump()`` (``_process_messages`` in serving_chat.py). The dump is not the client's
JSON: keys SGLang does not model are gone, ``type`` defaults to ``"function"``, a tool-level
``defer_loading`` is copied into the function, the tool always carries ``defer_loading``
(``null`` when unset), the function always carries ``description`` and ``parameters``
(``null`` when absent) but ``strict`` and ``defer_loading`` only when set, the function's keys
keep the client's order with the added ones after, and values are coerced as pydantic does
(``"strict": "yes"`` is ``true``). A template that prints the tools (``tools|tojson``) or
tests a key (``description is defined``) therefore renders differently from the client's
JSON, and the gateway's prompt would not be the one SGLang builds from the same request.

That is SGLang 0.5.23's dump. Before 0.5.23 (sglang_rules.py) `Function.strict` is a
``bool`` defaulting to ``false``, so every function carries ``"strict": false`` unless the
client said otherwise (and a ``"strict": null`` is refused), and the function's keys are in
the model's declaration order (description, name, parameters, strict, defer_loading), not
the client's.

`template_tools` gives that dump for the rules it is given: the same pydantic validation (so
the same coercions and the same refusals), then the same key layout. Callers' lists, and so
the session records, keep what the client sent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from sessiongate.sglang_rules import NEWEST, SglangRules
from sessiongate.tokenizer.template import TokenizerError

__all__ = ["template_tools"]


class _Function(BaseModel):
    # SGLang's `Function` fields, in its declaration order (the dump's order for keys the
    # client did not send). Unknown keys are ignored, as there.
    description: str | None = None
    name: str
    parameters: object | None = None
    strict: bool | None = None
    defer_loading: bool | None = None


class _Tool(BaseModel):
    type: str = "function"
    function: _Function
    defer_loading: bool | None = None


class _BoolStrictFunction(_Function):
    # Before 0.5.23: `strict: bool = False` (a null is not a bool: refused).
    strict: bool = False


class _BoolStrictTool(_Tool):
    function: _BoolStrictFunction


def _dump(tool: Mapping[str, Any], rules: SglangRules) -> dict[str, Any]:
    model = (_BoolStrictTool if rules.strict_always_dumped else _Tool).model_validate(tool)
    function = model.function
    if function.defer_loading is None and model.defer_loading is not None:
        function.defer_loading = model.defer_loading  # the tool's value reaches the function
    values = {name: getattr(function, name) for name in _Function.model_fields}
    # Dropped from the dump while unset (description and parameters stay as null).
    if values["defer_loading"] is None:
        del values["defer_loading"]
    if values["strict"] is None:
        del values["strict"]  # only where strict may be unset (0.5.23)
    order: list[str] = []
    sent = tool.get("function")
    if rules.function_keys_as_sent and isinstance(sent, Mapping):
        order = [key for key in sent if key in values]
    order += [key for key in values if key not in order]
    return {
        "type": model.type,
        "function": {key: values[key] for key in order},
        "defer_loading": model.defer_loading,
    }


def template_tools(
    tools: Sequence[Mapping[str, Any]] | None, rules: SglangRules = NEWEST
) -> list[dict[str, Any]] | None:
    """`tools` as SGLang (of `rules`) passes them to the chat template; None for none or an
    empty list (SGLang renders no tools then). TokenizerError naming the first tool SGLang's
    model refuses (missing function name, a description that is not a string, ...)."""
    if not tools:
        return None
    dumped: list[dict[str, Any]] = []
    for index, tool in enumerate(tools):
        try:
            dumped.append(_dump(tool, rules))
        except ValidationError as exc:
            error = exc.errors()[0]
            where = "".join(
                f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"]
            )
            raise TokenizerError(f"tools[{index}]{where}: {error['msg']}") from None
    return dumped

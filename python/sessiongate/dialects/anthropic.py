"""The Anthropic Messages dialect, as SGLang 0.5.23 serves it statelessly on `/v1/messages`.

Why restated here: a session turn asked in Anthropic's API must build the same chat body the
engine would have built itself (the prompt ids come from that body), and answer with the
same Messages reply, stream and errors a client of SGLang gets. Each function names the
SGLang function it restates (`sglang/srt/entrypoints/anthropic/serving.py` and
`protocol.py`, `http_server.py`'s error handlers). What SGLang decides from its engine
(inline system support, reasoning history, the reasoning toggle) is an `EngineTraits`.

Request validation restates the pydantic models of `protocol.py` by hand (no pydantic on
the turn's path), with strict JSON types: a string where a number belongs is refused, where
pydantic's lax mode would coerce "5" to 5. Refusals are `DialectError`s carrying SGLang's
status and Anthropic error type.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sessiongate.dialects import DialectError, compact_json
from sessiongate.json_safety import json_type

if TYPE_CHECKING:
    from sessiongate.dialects.anthropic_stream import MessageStreamRelay

# serving.py STOP_REASON_MAP: other finish reasons (abort, content_filter) are end_turn.
STOP_REASON_MAP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
# serving.py ERROR_TYPE_MAP, with http_server.py's HTTPException handler's 413 and 422.
ERROR_TYPE_MAP = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "request_timeout_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "api_error",
}
BLOCK_TYPES = (
    "text",
    "image",
    "tool_use",
    "tool_result",
    "tool_reference",
    "search_result",
    "thinking",
    "redacted_thinking",
)
_SERVER_TOOLS = (
    ("web_search", re.compile(r"^web_search_\d{8}$"), ("web_search",)),
    ("computer", re.compile(r"^computer_\d{8}$"), ("computer",)),
    ("bash", re.compile(r"^bash_\d{8}$"), ("bash",)),
    (
        "text_editor",
        re.compile(r"^text_editor_\d{8}$"),
        ("str_replace_editor", "str_replace_based_edit_tool"),
    ),
)
_PD_FIELDS = (
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "routed_dp_rank",
    "disagg_prefill_dp_rank",
)
_EFFORTS = ("minimal", "low", "medium", "high", "xhigh", "max")


@dataclass(frozen=True)
class EngineTraits:
    """What SGLang's conversion reads from its engine (serving_chat.py).

    - `merge_inline_system`: `not supports_inline_system`: system messages inside
      `messages` join the top-level system text.
    - `native_reasoning_history`: `supports_native_reasoning_history()`: prior thinking
      goes back as `reasoning_content` (Qwen3's template reads it); otherwise it is wrapped
      in `reasoning_wrap` (the detector's start and end tokens) into the content, or dropped
      without a detector.
    - `reasoning_toggle`: the chat-template kwarg `apply_reasoning_enabled` sets from
      `thinking` (`enable_thinking` for qwen3); None: the engine has no reasoning parser,
      so `thinking` enabled is refused and disabled is a no-op.
    """

    merge_inline_system: bool = False
    native_reasoning_history: bool = True
    reasoning_wrap: tuple[str, str] | None = ("<think>", "</think>")
    reasoning_toggle: str | None = "enable_thinking"


class _Invalid(Exception):
    """A pydantic-style validation failure: where, and what."""

    def __init__(self, loc: str, msg: str) -> None:
        super().__init__(f"{loc}: {msg}" if loc else msg)


def invalid_request(message: str) -> DialectError:
    return DialectError(400, "invalid_request_error", message)


# -- validation (protocol.py's models) ------------------------------------------------------


def _want(value: object, kind: str, loc: str, *, optional: bool = True) -> None:
    """`value` of JSON kind `kind` ("str", "int", "number", "bool", "dict", "list")."""
    if value is None and optional:
        return
    ok = {
        "str": isinstance(value, str),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, int | float) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "dict": isinstance(value, dict),
        "list": isinstance(value, list),
    }[kind]
    if not ok:
        names = {"int": "an integer", "number": "a number", "bool": "a boolean"}
        expected = names.get(kind, {"str": "a string", "dict": "an object"}.get(kind, "an array"))
        raise _Invalid(loc, f"Input should be {expected}, not {json_type(value)}")


def _required(body: dict[str, Any], key: str, kind: str, loc: str) -> Any:
    if key not in body:
        raise _Invalid(loc, "Field required")
    value = body[key]
    _want(value, kind, loc, optional=False)
    return value


def _check_block(block: object, loc: str) -> None:
    """One content block of protocol.py's `AnthropicContentBlock` union."""
    _want(block, "dict", loc, optional=False)
    assert isinstance(block, dict)
    kind = block.get("type")
    if kind not in BLOCK_TYPES:
        expected = ", ".join(repr(t) for t in BLOCK_TYPES)
        if kind is None:
            raise _Invalid(loc, f"Unable to extract tag using discriminator 'type' ({expected})")
        raise _Invalid(
            loc,
            f"Input tag {kind!r} found using 'type' does not match any of the expected "
            f"tags: {expected}",
        )
    at = f"{loc}.{kind}"
    if kind == "text":
        _required(block, "text", "str", f"{at}.text")
    elif kind == "image":
        source = block.get("source")
        if source is not None and not isinstance(source, dict | str):
            raise _Invalid(f"{at}.source", "Input should be an object or a string")
    elif kind == "tool_use":
        _required(block, "id", "str", f"{at}.id")
        _required(block, "name", "str", f"{at}.name")
        _want(block.get("input", {}), "dict", f"{at}.input", optional=False)
    elif kind == "tool_result":
        for key in ("tool_use_id", "id"):
            _want(block.get(key), "str", f"{at}.{key}")
        _want(block.get("is_error"), "bool", f"{at}.is_error")
        _check_content(block.get("content"), f"{at}.content", optional=True)
    elif kind == "tool_reference":
        for key in ("name", "tool_name", "id"):
            _want(block.get(key), "str", f"{at}.{key}")
    elif kind == "search_result":
        source = block.get("source")
        if source is not None and not isinstance(source, dict | str):
            raise _Invalid(f"{at}.source", "Input should be a string or an object")
        _want(block.get("title"), "str", f"{at}.title")
        content = block.get("content")
        _want(content, "list", f"{at}.content")
        for i, item in enumerate(content or []):
            _want(item, "dict", f"{at}.content.{i}", optional=False)
    elif kind == "thinking":
        _required(block, "thinking", "str", f"{at}.thinking")
        _want(block.get("signature"), "str", f"{at}.signature")
    else:  # redacted_thinking
        _want(block.get("data"), "str", f"{at}.data")


def _check_content(content: object, loc: str, *, optional: bool) -> None:
    if content is None and optional:
        return
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise _Invalid(loc, f"Input should be a string or an array, not {json_type(content)}")
    for i, block in enumerate(content):
        _check_block(block, f"{loc}.{i}")


def _check_tool(tool: object, loc: str) -> None:
    """protocol.py `AnthropicTool`: custom (`input_schema`) or a server tool family."""
    _want(tool, "dict", loc, optional=False)
    assert isinstance(tool, dict)
    kind = tool.get("type")
    _want(kind, "str", f"{loc}.type")
    _want(tool.get("description"), "str", f"{loc}.description")
    _want(tool.get("defer_loading"), "bool", f"{loc}.defer_loading")
    for family, pattern, names in _SERVER_TOOLS:
        if kind and kind.startswith(family + "_"):
            if not pattern.match(kind):
                raise _Invalid(f"{loc}.{family}.type", f"String should match {pattern.pattern!r}")
            name = tool.get("name", names[0])
            if name not in names:
                raise _Invalid(f"{loc}.{family}.name", f"Input should be {names!r}")
            return
    at = f"{loc}.custom"
    _required(tool, "name", "str", f"{at}.name")
    _required(tool, "input_schema", "dict", f"{at}.input_schema")
    if tool.get("strict") is not None:
        _want(tool.get("strict"), "bool", f"{at}.strict")


def _check_thinking(thinking: object) -> None:
    """protocol.py `AnthropicThinkingParam._validate_thinking_shape`."""
    _want(thinking, "dict", "thinking")
    if thinking is None:
        return
    assert isinstance(thinking, dict)
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise _Invalid("thinking.type", "Input should be 'enabled', 'disabled' or 'adaptive'")
    budget = thinking.get("budget_tokens")
    _want(budget, "int", "thinking.budget_tokens")
    display = thinking.get("display")
    if display is not None and display not in ("summarized", "omitted"):
        raise _Invalid("thinking.display", "Input should be 'summarized' or 'omitted'")
    if kind == "enabled":
        if budget is None:
            raise _Invalid(
                "thinking", "thinking.budget_tokens is required when thinking.type is 'enabled'"
            )
        if budget < 1024:
            raise _Invalid("thinking", f"thinking.budget_tokens must be >= 1024 (got {budget})")
    elif kind == "disabled":
        if budget is not None:
            raise _Invalid(
                "thinking",
                "thinking.budget_tokens is not allowed when thinking.type is 'disabled'",
            )
        if display is not None:
            raise _Invalid(
                "thinking", "thinking.display is not allowed when thinking.type is 'disabled'"
            )
    elif budget is not None:
        raise _Invalid(
            "thinking", "thinking.budget_tokens is not allowed when thinking.type is 'adaptive'"
        )


def _check_options(body: dict[str, Any]) -> None:
    """The request's scalar and option members (protocol.py `AnthropicMessagesRequest`)."""
    _want(body.get("metadata"), "dict", "metadata")
    stops = body.get("stop_sequences")
    _want(stops, "list", "stop_sequences")
    for i, stop in enumerate(stops or []):
        _want(stop, "str", f"stop_sequences.{i}", optional=False)
    _want(body.get("stream"), "bool", "stream")
    _check_content(body.get("system"), "system", optional=True)
    for key in ("temperature", "top_p"):
        _want(body.get(key), "number", key)
    _want(body.get("top_k"), "int", "top_k")
    _check_thinking(body.get("thinking"))
    choice = body.get("tool_choice")
    _want(choice, "dict", "tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") not in ("auto", "any", "tool", "none"):
            raise _Invalid("tool_choice.type", "Input should be 'auto', 'any', 'tool' or 'none'")
        _want(choice.get("name"), "str", "tool_choice.name")
        _want(
            choice.get("disable_parallel_tool_use"), "bool", "tool_choice.disable_parallel_tool_use"
        )
    tools = body.get("tools")
    _want(tools, "list", "tools")
    for i, tool in enumerate(tools or []):
        _check_tool(tool, f"tools.{i}")
    config = body.get("output_config")
    _want(config, "dict", "output_config")
    if isinstance(config, dict):
        effort = config.get("effort")
        if effort is not None and effort not in _EFFORTS:
            raise _Invalid("output_config.effort", f"Input should be one of {_EFFORTS!r}")
        _want(config.get("task_budget"), "dict", "output_config.task_budget")
        fmt = config.get("format")
        _want(fmt, "dict", "output_config.format")
        if isinstance(fmt, dict):
            if fmt.get("type") != "json_schema":
                raise _Invalid("output_config.format.type", "Input should be 'json_schema'")
            _required(fmt, "schema", "dict", "output_config.format.schema")
    betas = body.get("betas")
    _want(betas, "list", "betas")


def validate_request(body: dict[str, Any]) -> None:
    """protocol.py `AnthropicMessagesRequest` as http_server.py answers its failures: 400
    `invalid_request_error`, "loc: msg" (`_anthropic_validation_message`)."""
    try:
        model = _required(body, "model", "str", "model")
        messages = _required(body, "messages", "list", "messages")
        for i, message in enumerate(messages):
            loc = f"messages.{i}"
            _want(message, "dict", loc, optional=False)
            if message.get("role") not in ("user", "assistant", "system"):
                raise _Invalid(f"{loc}.role", "Input should be 'user', 'assistant' or 'system'")
            if "content" not in message:
                raise _Invalid(f"{loc}.content", "Field required")
            _check_content(message["content"], f"{loc}.content", optional=False)
        max_tokens = _required(body, "max_tokens", "int", "max_tokens")
        _check_options(body)
        if not model:
            raise _Invalid("model", "Value error, Model is required")
        if max_tokens <= 0:
            raise _Invalid("max_tokens", "Value error, max_tokens must be positive")
    except _Invalid as exc:
        text = str(exc)
        raise invalid_request(text[:500] + "…" if len(text) > 500 else text) from None


# -- request conversion (serving.py `_convert_to_chat_completion_request`) -------------------


def _image_part(source: object) -> dict[str, Any] | None:
    """`_convert_anthropic_image_source_to_openai_part`."""
    if not isinstance(source, dict):
        return None
    if source.get("type") == "base64":
        data = source.get("data", "")
        if not data:
            return None
        media = source.get("media_type", "image/png")
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    url = source.get("url")
    return {"type": "image_url", "image_url": {"url": url}} if url else None


def _search_text(item: dict[str, Any]) -> str:
    """`_text_from_search_result`."""
    parts = []
    if item.get("title"):
        parts.append(f"Title: {item['title']}")
    source = item.get("source")
    if isinstance(source, dict):
        text = source.get("url") or source.get("text")
        if text:
            parts.append(f"Source: {text}")
    elif source:
        parts.append(f"Source: {source}")
    content = item.get("content")
    texts = []
    if isinstance(content, str):
        texts.append(content)
    elif isinstance(content, list):
        texts.extend(
            p["text"]
            for p in content
            if isinstance(p, dict) and p.get("type") == "text" and p.get("text")
        )
    if texts:
        parts.append("Content: " + "\n".join(texts))
    return "\n".join(parts)


def _tool_result_content(content: object) -> tuple[list[Any], str]:
    """`_convert_tool_result_content`: the tool messages' contents and the joined text."""
    if not isinstance(content, list):
        text = str(content) if content else ""
        return [text], text
    parts: list[dict[str, Any]] = []
    texts: list[str] = []
    for item in content:
        kind = item.get("type")
        if kind == "text":
            if item.get("text"):
                texts.append(item["text"])
                parts.append({"type": "text", "text": item["text"]})
        elif kind == "image":
            image = _image_part(item.get("source"))
            if image is not None:
                parts.append(image)
        elif kind == "tool_reference":
            name = item.get("tool_name") or item.get("name")
            if name:
                parts.append({"type": "tool_reference", "name": name})
        elif kind == "search_result":
            text = _search_text(item)
            if text:
                texts.append(text)
                parts.append({"type": "text", "text": text})
    # GLM templates expand references only at the start of a tool message: runs of
    # references and of other parts become separate tool messages, order kept.
    groups: list[list[dict[str, Any]]] = []
    for part in parts:
        is_reference = part["type"] == "tool_reference"
        if not groups or (groups[-1][0]["type"] == "tool_reference") != is_reference:
            groups.append([])
        groups[-1].append(part)
    contents: list[Any] = [
        g[0]["text"] if len(g) == 1 and g[0]["type"] == "text" else g for g in groups
    ]
    return contents or [""], "\n".join(texts)


def _assistant_thinking(
    blocks: list[dict[str, Any]], traits: EngineTraits
) -> tuple[str | None, str | None]:
    """`_convert_assistant_thinking_blocks`: (reasoning_content, text to splice), one set."""
    if any(b["type"] == "redacted_thinking" for b in blocks):
        raise ValueError("Anthropic redacted_thinking history is not supported")
    thoughts = [b["thinking"] for b in blocks if b["type"] == "thinking" and b["thinking"]]
    if not thoughts:
        return None, None
    text = "\n".join(thoughts)
    if traits.native_reasoning_history:
        return text, None
    if traits.reasoning_wrap is None:
        return None, None  # no detector: SGLang logs and drops the history
    start, end = traits.reasoning_wrap
    return None, f"{start}{text}\n{end}"


def _system_text(content: str | list[dict[str, Any]]) -> str | None:
    """`_extract_system_text`: a system message's text, trimmed, or None."""
    if isinstance(content, str):
        return content.strip() or None
    texts = [(b.get("text") or "").strip() for b in content if b.get("type") == "text"]
    texts = [t for t in texts if t]
    return "\n".join(texts) if texts else None


def _convert_blocks(
    message: dict[str, Any], traits: EngineTraits, out: list[dict[str, Any]]
) -> None:
    """One message with content blocks, appended to `out` as chat messages."""
    role = message["role"]
    blocks: list[dict[str, Any]] = message["content"]
    chat: dict[str, Any] = {"role": role}
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []

    def flush_user() -> None:
        if parts:
            one_text = len(parts) == 1 and parts[0]["type"] == "text"
            out.append({"role": "user", "content": parts[0]["text"] if one_text else list(parts)})
            parts.clear()

    if role == "assistant":
        reasoning, history = _assistant_thinking(blocks, traits)
        if reasoning is not None:
            chat["reasoning_content"] = reasoning
        if history is not None:
            parts.append({"type": "text", "text": history})
    for block in blocks:
        kind = block["type"]
        if kind == "text":
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and block.get("source"):
            image = _image_part(block["source"])
            if image is not None:
                parts.append(image)
        elif kind == "search_result":
            text = _search_text(block)
            if text:
                parts.append({"type": "text", "text": text})
        elif kind == "tool_use":
            arguments = json.dumps(block.get("input") or {})
            calls.append(
                {
                    "id": block["id"] or f"call_{uuid.uuid4().hex}",
                    "type": "function",
                    "function": {"name": block["name"] or "", "arguments": arguments},
                }
            )
        elif kind == "tool_result":
            contents, text = _tool_result_content(block.get("content"))
            call_id = block.get("tool_use_id") or block.get("id") or ""
            if role == "user":
                flush_user()
                out.extend(
                    {"role": "tool", "tool_call_id": call_id, "content": c} for c in contents
                )
            else:
                parts.append({"type": "text", "text": f"Tool result: {text}"})
    if calls:
        chat["tool_calls"] = calls
    if parts:
        one_text = len(parts) == 1 and parts[0]["type"] == "text"
        chat["content"] = parts[0]["text"] if one_text else parts
        out.append(chat)
    elif calls:
        out.append(chat)
    elif role != "user":
        chat["content"] = ""
        out.append(chat)


def _chat_messages(body: dict[str, Any], traits: EngineTraits) -> list[dict[str, Any]]:
    system_parts: list[str] = []
    system = body.get("system")
    if isinstance(system, str):
        if system.strip():
            system_parts.append(system)
    elif system:
        system_parts.extend(b["text"] for b in system if b["type"] == "text" and b["text"])
    if traits.merge_inline_system:
        for message in body["messages"]:
            if message["role"] == "system":
                text = _system_text(message["content"])
                if text:
                    system_parts.append(text)
    out: list[dict[str, Any]] = []
    if system_parts:
        out.append({"role": "system", "content": "\n".join(system_parts)})
    for message in body["messages"]:
        if message["role"] == "system" and traits.merge_inline_system:
            continue
        if isinstance(message["content"], str):
            out.append({"role": message["role"], "content": message["content"]})
        else:
            _convert_blocks(message, traits, out)
    return out


def _chat_tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Custom tools as chat functions; Anthropic's server tools are skipped."""
    tools = []
    for tool in body.get("tools") or []:
        kind = tool.get("type")
        if kind and any(kind.startswith(family + "_") for family, _, _ in _SERVER_TOOLS):
            continue
        schema = dict(tool["input_schema"])
        schema.setdefault("type", "object")
        converted: dict[str, Any] = {
            "type": "function",
            "function": {
                "name": tool["name"],
                "description": tool.get("description") or "",
                "parameters": schema,
                "strict": bool(tool.get("strict", False)),
            },
        }
        if tool.get("defer_loading") is not None:
            converted["defer_loading"] = tool["defer_loading"]
        tools.append(converted)
    return tools


def _apply_tool_choice(body: dict[str, Any], chat: dict[str, Any]) -> None:
    choice = body.get("tool_choice")
    tools = chat.get("tools")
    if choice is None:
        if tools:
            chat["tool_choice"] = "auto"
        return
    kind = choice["type"]
    chat["parallel_tool_calls"] = not choice.get("disable_parallel_tool_use", False)
    if kind == "none":
        chat["tool_choice"] = "none"
    elif tools:
        if kind == "auto":
            chat["tool_choice"] = "auto"
        elif kind == "any":
            chat["tool_choice"] = "required"
        elif kind == "tool":
            name = choice.get("name")
            if not any(t["function"]["name"] == name for t in tools):
                raise ValueError(
                    f"tool_choice references tool {name!r} but it is not in the forwarded "
                    "tools list (server-side Anthropic tools cannot be selected)"
                )
            chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    elif kind in ("any", "tool"):
        raise ValueError(
            f"tool_choice={kind!r} requires at least one custom tool; all supplied tools were "
            "server-side Anthropic built-ins which the OpenAI-compatible backend cannot invoke"
        )


def _apply_thinking(body: dict[str, Any], chat: dict[str, Any], traits: EngineTraits) -> None:
    """serving_chat.py `apply_reasoning_enabled` for a toggled (or parser-less) engine."""
    thinking = body.get("thinking")
    if thinking is None:
        return
    enabled = thinking["type"] != "disabled"
    if traits.reasoning_toggle is None:
        if enabled:
            raise ValueError(
                "Anthropic thinking is not supported for models without a reasoning parser"
            )
        return
    chat["chat_template_kwargs"] = {
        **(chat.get("chat_template_kwargs") or {}),
        traits.reasoning_toggle: enabled,
    }


def messages_to_chat(body: dict[str, Any], traits: EngineTraits | None = None) -> dict[str, Any]:
    """serving.py `_convert_to_chat_completion_request`: the chat body SGLang builds from a
    Messages body (members it leaves unset are absent). DialectError: a 400
    `invalid_request_error`, as `handle_messages` answers the conversion's failures."""
    traits = traits or EngineTraits()
    validate_request(body)
    try:
        chat: dict[str, Any] = {
            "messages": _chat_messages(body, traits),
            "model": body["model"],
            "max_tokens": body["max_tokens"],
            "stream": bool(body.get("stream")),
        }
        chat.update({k: body[k] for k in _PD_FIELDS if body.get(k) is not None})
        for key in ("temperature", "top_p", "top_k"):
            if body.get(key) is not None:
                chat[key] = body[key]
        if body.get("stop_sequences") is not None:
            chat["stop"] = body["stop_sequences"]
        if body.get("stream"):
            chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        _apply_thinking(body, chat, traits)
        config = body.get("output_config")
        if config is not None:
            if config.get("format") is not None:
                schema = config["format"]["schema"]
                chat["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {"name": "response", "schema": schema, "strict": True},
                }
            if config.get("effort") is not None:
                chat["reasoning_effort"] = (
                    "max" if config["effort"] == "xhigh" else config["effort"]
                )
        tools = _chat_tools(body)
        if tools:
            chat["tools"] = tools
        _apply_tool_choice(body, chat)
    except ValueError as exc:
        raise invalid_request(str(exc)) from None
    return chat


def check_tool_links(body: dict[str, Any]) -> None:
    """A session's own rule, not SGLang's: every `tool_result` answers a `tool_use` of the
    assistant message right before it (as Anthropic's API requires). A session would
    otherwise record a tool message the model never asked for. 400 naming the block."""
    previous: set[str] = set()
    for i, message in enumerate(body["messages"]):
        content = message["content"]
        blocks = content if isinstance(content, list) else []
        if message["role"] == "user":
            for j, block in enumerate(blocks):
                if block["type"] != "tool_result":
                    continue
                ref = block.get("tool_use_id") or block.get("id")
                if ref not in previous:
                    raise invalid_request(
                        f"messages.{i}.content.{j}: tool_result block references tool_use_id "
                        f"{ref!r}, which no tool_use block of the preceding assistant message has"
                    )
        previous = (
            {b["id"] for b in blocks if b["type"] == "tool_use"}
            if message["role"] == "assistant"
            else set()
        )


# -- reply conversion (serving.py `_convert_response`, `_generate_anthropic_stream`) ---------


def _usage(usage: object, *, include_input: bool, zero_output: bool = False) -> dict[str, int]:
    """`_anthropic_usage_from_openai` (output always included)."""
    if not isinstance(usage, dict):
        return {"input_tokens": 0, "output_tokens": 0} if include_input else {"output_tokens": 0}
    out: dict[str, int] = {}
    details = usage.get("prompt_tokens_details")
    cached = (details.get("cached_tokens") if isinstance(details, dict) else 0) or 0
    if include_input:
        out["input_tokens"] = max((usage.get("prompt_tokens") or 0) - cached, 0)
        if cached:
            out["cache_read_input_tokens"] = cached
    out["output_tokens"] = 0 if zero_output else (usage.get("completion_tokens") or 0)
    return out


def _tool_input(arguments: object) -> dict[str, Any]:
    try:
        parsed = json.loads(arguments)  # type: ignore[arg-type]
    except (ValueError, TypeError):
        return {}
    return parsed if isinstance(parsed, dict) else {}


def chat_reply_to_message(
    chat_reply: dict[str, Any], request: dict[str, Any], *, message_id: str | None = None
) -> dict[str, Any]:
    """serving.py `_convert_response`, dumped with `exclude_none`: thinking, text, then
    tool_use blocks (arguments parsed; not an object: `{}`), the stop reason, the usage."""
    msg_id = message_id or f"msg_{uuid.uuid4().hex}"
    choices = chat_reply.get("choices") or []
    model = chat_reply.get("model")
    if not choices:
        usage = {"input_tokens": 0, "output_tokens": 0}
        return {
            "id": msg_id,
            "type": "message",
            "role": "assistant",
            "content": [{"type": "text", "text": ""}],
            "model": model,
            "stop_reason": "end_turn",
            "usage": usage,
        }
    choice = choices[0]
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"]})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        content.append(
            {
                "type": "tool_use",
                "id": call.get("id"),
                "name": function.get("name"),
                "input": _tool_input(function.get("arguments")),
            }
        )
    if not content:
        content.append({"type": "text", "text": ""})
    stop_reason = STOP_REASON_MAP.get(choice.get("finish_reason") or "stop", "end_turn")
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "content": content,
        "model": model,
        "stop_reason": stop_reason,
        "usage": _usage(chat_reply.get("usage"), include_input=True),
    }


def _event(kind: str, payload: dict[str, Any]) -> bytes:
    """serving.py `_wrap_sse_event`."""
    return (
        b"event: " + kind.encode() + b"\ndata: " + compact_json({"type": kind, **payload}) + b"\n\n"
    )


def message_stream_events(
    chat_reply: dict[str, Any], request: dict[str, Any], *, message_id: str | None = None
) -> list[bytes]:
    """The events `_generate_anthropic_stream` sends for this reply, made from the buffered
    chat reply: message_start (input usage, output 0), per block start / delta / stop in
    the non-stream reply's order (thinking_delta, text_delta, input_json_delta of the
    arguments text), message_delta (stop reason, output usage), message_stop. As SGLang's
    stream: empty text and thinking open no block, and a reply with nothing opens none."""
    msg_id = message_id or f"msg_{uuid.uuid4().hex}"
    usage = chat_reply.get("usage")
    start: dict[str, Any] = {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": request.get("model"),
        "usage": _usage(usage, include_input=True, zero_output=True),
    }
    events = [_event("message_start", {"message": start})]
    choices = chat_reply.get("choices") or []
    choice = choices[0] if choices else {}
    message = choice.get("message") or {}
    deltas: list[tuple[dict[str, Any], dict[str, Any] | None]] = []
    if message.get("reasoning_content"):
        delta = {"type": "thinking_delta", "thinking": message["reasoning_content"]}
        deltas.append(({"type": "thinking", "thinking": ""}, delta))
    if message.get("content"):
        deltas.append(
            ({"type": "text", "text": ""}, {"type": "text_delta", "text": message["content"]})
        )
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        if not function.get("name"):
            continue  # SGLang opens a tool_use block only on a named call
        block = {
            "type": "tool_use",
            "id": call.get("id") or f"toolu_{uuid.uuid4().hex}",
            "name": function["name"],
            "input": {},
        }
        arguments = function.get("arguments")
        deltas.append(
            (block, {"type": "input_json_delta", "partial_json": arguments} if arguments else None)
        )
    for index, (block, step) in enumerate(deltas):
        events.append(_event("content_block_start", {"index": index, "content_block": block}))
        if step is not None:
            events.append(_event("content_block_delta", {"index": index, "delta": step}))
        events.append(_event("content_block_stop", {"index": index}))
    stop_reason = STOP_REASON_MAP.get(choice.get("finish_reason") or "stop", "end_turn")
    end_usage = (
        _usage(usage, include_input=False) if isinstance(usage, dict) else {"output_tokens": 0}
    )
    events.append(
        _event("message_delta", {"delta": {"stop_reason": stop_reason}, "usage": end_usage})
    )
    events.append(_event("message_stop", {}))
    return events


# -- errors (http_server.py `_anthropic_error_response`, serving.py `_error_response`) -------


def error_envelope(status: int, message: str, error_type: str | None = None) -> dict[str, Any]:
    """`{"type": "error", "error": {"type", "message"}}`, the type from the status."""
    kind = error_type or ERROR_TYPE_MAP.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _scrub(message: str, status: int) -> str:
    """serving.py `_scrub_error_message`."""
    if status >= 500:
        return "Internal server error"
    if not message:
        return "Request failed"
    lines = [
        ln for ln in message.splitlines() if not ln.startswith("Traceback") and 'File "/' not in ln
    ]
    cleaned = "\n".join(lines).strip()
    if len(cleaned) > 500:
        cleaned = cleaned[:500] + "…"
    return cleaned or "Request failed"


def engine_error_to_envelope(status: int, body: bytes) -> dict[str, Any]:
    """serving.py `_convert_openai_error_response`: an engine's chat error reply as the
    Anthropic error (4xx keep the engine's message and type; 5xx say nothing more)."""
    kind = ERROR_TYPE_MAP.get(status, "api_error")
    message: str | None = None
    try:
        payload = json.loads(body.decode("utf-8")) if body else None
    except (ValueError, UnicodeDecodeError):
        message = body.decode("utf-8", errors="replace")[:500]
    else:
        if isinstance(payload, dict):
            err = payload.get("error", payload)
            if isinstance(err, dict):
                message = err.get("message") or payload.get("message")
                if status < 500 and isinstance(err.get("type"), str) and err["type"]:
                    kind = err["type"]
            elif isinstance(err, str):
                message = err
            elif isinstance(payload.get("message"), str):
                message = payload["message"]
    return error_envelope(status, _scrub(str(message or ""), status), kind)


@dataclass(frozen=True)
class AnthropicDialect:
    """The `Dialect` of `POST .../v1/messages` (sessiongate.dialects)."""

    traits: EngineTraits = EngineTraits()
    # The session route's own rule (`check_tool_links`); the mock engine, as SGLang, has none.
    tool_links: bool = True
    name: str = "anthropic"
    # Under --stream-upstream relay the engine's chat chunks become events as they arrive.
    relays_streams: bool = True
    make_id: Callable[[], str] | None = None

    def to_chat(
        self, body: dict[str, Any], history: Callable[[str], list[dict[str, Any]]] | None = None
    ) -> dict[str, Any]:
        chat = messages_to_chat(body, self.traits)
        if self.tool_links:
            check_tool_links(body)
        return chat

    def from_chat(self, chat_reply: dict[str, Any], request: dict[str, Any]) -> bytes:
        return compact_json(chat_reply_to_message(chat_reply, request, message_id=self._id()))

    def stream_events(self, chat_reply: dict[str, Any], request: dict[str, Any]) -> bytes:
        return b"".join(message_stream_events(chat_reply, request, message_id=self._id()))

    def stream_relay(self, request: dict[str, Any], prompt_tokens: int) -> MessageStreamRelay:
        from sessiongate.dialects.anthropic_stream import MessageStreamRelay

        return MessageStreamRelay(request, prompt_tokens, message_id=self._id())

    def error_body(self, status: int, message: str, error_type: str | None = None) -> bytes:
        return compact_json(error_envelope(status, message, error_type))

    def engine_error(self, status: int, body: bytes) -> bytes:
        return compact_json(engine_error_to_envelope(status, body))

    def _id(self) -> str | None:
        return self.make_id() if self.make_id is not None else None


ANTHROPIC = AnthropicDialect()

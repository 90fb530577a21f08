"""The OpenAI Responses dialect: a Responses request as the chat body SGLang renders, and a
chat reply as the Responses object and `response.*` events SGLang answers.

Why a conversion and not a relay: SGLang 0.5.23 serves `POST /v1/responses` by turning the
request into chat messages and tools, rendering them with the chat template and parsing the
output with the chat path's reasoning and tool-call parsers
(`sglang/srt/entrypoints/openai/serving_responses.py`, `OpenAIServingResponses`). sessiongate
builds prompt ids itself from chat messages (token-in-token-out) and talks to the engine's
`/v1/chat/completions` only, so it does the same conversion on its side: the prompt a
Responses client gets is the one SGLang would render, and the reply is shaped as SGLang
shapes it. Every rule below names the SGLang function it restates.

Pure functions, no I/O: `responses_to_chat` (request -> chat body), `chat_reply_to_response`
(chat reply -> Responses object), `response_stream_events` (chat reply -> SSE events, as
SGLang streams such a result), `error_body` (SGLang's error envelope on this route). Refusals
raise `DialectError`. What is refused and why is in docs/api.md, "OpenAI Responses sessions".

Divergences kept on purpose (each documented there): `previous_response_id` is resolved by
the caller's `previous` callback (the session's own turns) instead of SGLang's response
store; a function call's `call_id` is the chat reply's tool-call id (same `call_` format as
SGLang's fresh one) so the id the client echoes matches the recorded turn; the stream here
is built from a buffered reply, so each item has one delta (a relayed turn's stream is
converted chunk by chunk in responses_stream.py).
"""

from __future__ import annotations

import base64
import json
import time
import uuid
import zlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from sessiongate.dialects.errors import DialectError

if TYPE_CHECKING:
    from sessiongate.dialects.responses_stream import ResponseStreamRelay

Previous = Callable[[str], list[dict[str, Any]]]
"""The session's own history for a `previous_response_id`: the Responses items SGLang keeps
in its `msg_store` for that response (its input history, then its output items as dumped);
raises KeyError for an id the session does not know."""

# protocol.py RESPONSE_TOOL_TYPES: the tool types SGLang's request model accepts.
RESPONSE_TOOL_TYPES = frozenset(
    {
        "function",
        "web_search",
        "web_search_preview",
        "code_interpreter",
        "file_search",
        "image_generation",
        "computer_use_preview",
        "local_shell",
        "shell",
        "mcp",
        "custom",
        "namespace",
        "tool_search",
    }
)
# protocol.py ResponsesRequest.include: the accepted values.
INCLUDE_VALUES = frozenset(
    {
        "code_interpreter_call.outputs",
        "computer_call_output.output.image_url",
        "file_search_call.results",
        "message.input_image.image_url",
        "message.output_text.logprobs",
        "reasoning.encrypted_content",
    }
)
# protocol.py ECHOABLE_REASONING_EFFORTS: the efforts the response echoes.
ECHOABLE_REASONING_EFFORTS = frozenset({"minimal", "low", "medium", "high"})
# protocol.py ResponsesRequest._DEFAULT_SAMPLING_PARAMS (temperature, top_p).
DEFAULT_TEMPERATURE = 0.7
DEFAULT_TOP_P = 1.0
# responses_adapters.py DEVELOPER_BLOCK_LABEL and _REASONING_STATE_PREFIX.
DEVELOPER_BLOCK_LABEL = "Developer instructions:"
REASONING_STATE_PREFIX = "sglang-reasoning-v1."
# The tool types converted to chat tools (`custom` through SGLang's single-string shim).
CONVERTED_TOOL_TYPES = frozenset({"function", "custom"})
# responses_adapters.py CUSTOM_TOOL_INPUT_KEY.
CUSTOM_TOOL_INPUT_KEY = "input"
# Content parts sessiongate converts; images, files and audio are refused (text prompts).
TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
MEDIA_PARTS = frozenset({"input_image", "input_file", "input_audio", "image_url"})


# ---- errors -------------------------------------------------------------------------------


def error_body(error: DialectError) -> dict[str, Any]:
    """SGLang's envelope on /v1/responses (serving_responses.py `create_error_response`,
    http_server.py's handlers for this path): `{"error": {message, type, param, code}}`."""
    return {
        "error": {
            "message": error.message,
            "type": error.error_type,
            "param": error.param,
            "code": error.status,
        }
    }


def _invalid(message: str, param: str | None = None, status: int = 400) -> DialectError:
    # serving_responses.py create_error_response's default type.
    return DialectError(status, "invalid_request_error", message, param)


def _validation(message: str) -> DialectError:
    # http_server.py RequestValidationError handler for /v1/responses: type "Bad Request".
    return DialectError(400, "Bad Request", message)


# ---- request -> chat ----------------------------------------------------------------------


def effective_tool_choice(body: Mapping[str, Any]) -> str | dict[str, Any]:
    """protocol.py `ResponsesRequest.effective_tool_choice`: of the object forms only a named
    function/custom tool survives (`{"type", "name"}`); any other object is "auto"."""
    choice = body.get("tool_choice", "auto")
    if not isinstance(choice, dict):
        return str(choice)
    function = choice.get("function")
    name = choice.get("name") or (function.get("name") if isinstance(function, dict) else None)
    if choice.get("type") in ("function", "custom") and name:
        out: dict[str, Any] = {"type": choice["type"], "name": name}
        if "namespace" in choice:
            out["namespace"] = choice["namespace"]
        return out
    return "auto"


def _reasoning_effort(body: Mapping[str, Any]) -> str | None:
    """protocol.py `ResponseReasoningParam`: `effort` defaults to "medium" once `reasoning`
    is given at all."""
    reasoning = body.get("reasoning")
    if not isinstance(reasoning, dict):
        return None
    effort = reasoning.get("effort", "medium")
    return effort if isinstance(effort, str) else None


def _check_request(body: Mapping[str, Any]) -> None:
    """The refusals, in serving_responses.py `create_responses`' order where it has them."""
    value = body.get("input")
    if not isinstance(value, (str, list)) or (
        isinstance(value, list) and not all(isinstance(item, dict) for item in value)
    ):
        raise _validation("input: Input should be a valid string or a list of objects")
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise _validation("tools: Input should be a valid list of objects")
    for tool in tools:
        kind = tool.get("type")
        if kind not in RESPONSE_TOOL_TYPES:
            raise _validation(f"tools: Input should be one of {sorted(RESPONSE_TOOL_TYPES)}")
        if kind == "function" and not tool.get("name"):
            raise _validation("Value error, Function tools must include a name.")
    for kind in (tool["type"] for tool in tools):
        if kind == "shell":
            raise _invalid("Shell tools are not supported by this model", "tools")
        if kind not in CONVERTED_TOOL_TYPES:
            raise _invalid(
                f"Tool type {kind!r} is not supported by sessiongate's Responses dialect: "
                "only function and custom tools are converted (built-in tools run inside "
                "SGLang's server)",
                "tools",
            )
    if not isinstance(body.get("tool_choice", "auto"), dict) and body.get(
        "tool_choice", "auto"
    ) not in (
        "auto",
        "required",
        "none",
    ):
        raise _validation("tool_choice: Input should be 'auto', 'required', 'none' or an object")
    include = body.get("include") or []
    if not isinstance(include, list) or any(value not in INCLUDE_VALUES for value in include):
        raise _validation(f"include: Input should be a list of {sorted(INCLUDE_VALUES)}")
    if body.get("background"):
        raise _invalid(
            "background=true is not supported: sessiongate answers Responses statelessly "
            "on the request's connection",
            "background",
        )
    if body.get("tool_choice") == "required" and not any(
        tool["type"] in CONVERTED_TOOL_TYPES for tool in tools
    ):
        raise _invalid(
            'tool_choice="required" requires at least one tool with '
            'type="function" or type="custom"; other built-in tool types '
            "cannot be forced."
        )
    choice = effective_tool_choice(body)
    if isinstance(choice, dict) and not any(
        tool["type"] in CONVERTED_TOOL_TYPES and tool.get("name") == choice["name"]
        for tool in tools
    ):
        raise _invalid(f"Tool {choice['name']!r} is not declared in tools", "tool_choice")
    if "message.output_text.logprobs" in include and body.get("stream"):
        raise _invalid("logprobs are not supported in streaming mode", "logprobs")


def _history(body: Mapping[str, Any], previous: Previous | None) -> list[dict[str, Any]]:
    """serving_responses.py `_response_input_history`: the stored items of
    `previous_response_id` (here: the session's), then this request's input (a string is
    one user message). `create_responses` and `_make_invalid_id_error` /
    `_make_not_found_error` give the errors."""
    history: list[dict[str, Any]] = []
    previous_id = body.get("previous_response_id")
    if previous_id is not None:
        if previous is None:
            raise _invalid(
                "previous_response_id is only resolved inside a session "
                "(POST /sessions/{id}/v1/responses): a stateless request must resend the "
                "whole input (store=false)",
                "previous_response_id",
            )
        if not isinstance(previous_id, str) or not previous_id.startswith("resp_"):
            raise _invalid(
                f"Invalid 'response_id': '{previous_id}'. Expected an ID that begins with 'resp'.",
                "response_id",
            )
        try:
            history = list(previous(previous_id))
        except KeyError:
            raise _invalid(
                f"Response with id '{previous_id}' not found.", "response_id", 404
            ) from None
    value = body["input"]
    if isinstance(value, str):
        history.append({"role": "user", "content": value})
    else:
        history.extend(value)
    return history


def label_developer_content(content: Any) -> Any:
    """responses_adapters.py `label_developer_content`: a developer message becomes system,
    its first text prefixed with "Developer instructions:"."""
    if isinstance(content, str):
        return f"{DEVELOPER_BLOCK_LABEL}\n{content}"
    if isinstance(content, list):
        for index, part in enumerate(content):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                labelled = {**part, "text": f"{DEVELOPER_BLOCK_LABEL}\n{part['text']}"}
                return [*content[:index], labelled, *content[index + 1 :]]
        return [{"type": "input_text", "text": DEVELOPER_BLOCK_LABEL}, *content]
    return content


def encode_reasoning_state(text: str) -> str:
    """responses_adapters.py `encode_reasoning_state`: the `encrypted_content` blob."""
    packed = base64.urlsafe_b64encode(zlib.compress(text.encode("utf-8")))
    return REASONING_STATE_PREFIX + packed.decode("ascii")


def decode_reasoning_state(blob: Any) -> str | None:
    """responses_adapters.py `decode_reasoning_state`."""
    if not isinstance(blob, str) or not blob.startswith(REASONING_STATE_PREFIX):
        return None
    try:
        raw = base64.urlsafe_b64decode(blob[len(REASONING_STATE_PREFIX) :])
        return zlib.decompress(raw).decode("utf-8")
    except (ValueError, zlib.error, UnicodeDecodeError):
        return None


def _content_part(part: Any) -> Any:
    """serving_responses.py `_normalize_response_content_part_for_chat`, text only:
    input_text/output_text -> `{"type": "text", "text"}`; media parts are refused."""
    if not isinstance(part, dict):
        return part
    kind = part.get("type")
    if kind in ("input_text", "output_text"):
        return {"type": "text", "text": part.get("text", "")}
    if kind in MEDIA_PARTS:
        raise _invalid(
            f"Content part type {kind!r} is not supported by sessiongate's Responses "
            "dialect: prompts are text",
            "input",
        )
    return part


def _arguments(raw: Any) -> str:
    """serving_responses.py `_normalize_response_message_for_chat` (function_call): the
    arguments as a JSON-object string, "{}" when they are not one."""
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = None
        return raw if isinstance(parsed, dict) else "{}"
    if isinstance(raw, dict):
        return json.dumps(raw, ensure_ascii=False, separators=(",", ":"))
    return "{}"


def _reasoning_message(item: dict[str, Any]) -> dict[str, Any] | None:
    """A reasoning item as `{role: assistant, reasoning_content}`: summary texts, else
    content texts, else the decoded `encrypted_content`; None when empty (dropped)."""

    def texts(parts: Any) -> list[str]:
        return [
            entry["text"] for entry in parts or [] if isinstance(entry, dict) and entry.get("text")
        ]

    found = texts(item.get("summary")) or texts(item.get("content"))
    if not found:
        restored = decode_reasoning_state(item.get("encrypted_content"))
        found = [restored] if restored else []
    if not found:
        return None
    return {"role": "assistant", "reasoning_content": "\n".join(found)}


def input_item_to_message(item: dict[str, Any]) -> dict[str, Any] | None:
    """serving_responses.py `_normalize_response_message_for_chat`: one Responses input item
    as one chat message (None: dropped)."""
    if item.get("role") == "developer":
        item = {**item, "role": "system", "content": label_developer_content(item.get("content"))}
    kind = item.get("type")
    if kind == "function_call":
        call_id = item.get("call_id") or item.get("id")
        function = {"name": item.get("name"), "arguments": _arguments(item.get("arguments"))}
        return {
            "role": "assistant",
            "tool_calls": [{"id": call_id, "type": "function", "function": function}],
        }
    if kind == "custom_tool_call":
        # Replayed through the same single-string shim the tool was offered as.
        arguments = encode_custom_tool_input(item.get("input") or "")
        function = {"name": item.get("name"), "arguments": arguments}
        return {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": item.get("call_id") or item.get("id"),
                    "type": "function",
                    "function": function,
                }
            ],
        }
    if kind in ("function_call_output", "custom_tool_call_output"):
        output = item.get("output", "")
        if isinstance(output, list):  # `_flatten_tool_output`
            output = "".join(p.get("text", "") for p in output if isinstance(p, dict))
        return {"role": "tool", "tool_call_id": item.get("call_id"), "content": output}
    if kind == "reasoning":
        return _reasoning_message(item)
    if kind not in (None, "message"):
        # `_construct_input_messages` raises ValueError; `create_responses` answers
        # create_error_response(f"{e} {e.__cause__}").
        raise _invalid(f"Unsupported Responses API input item type: {kind!r} None")
    content = item.get("content")
    if isinstance(content, list):
        item = {**item, "content": [_content_part(part) for part in content]}
    return {k: v for k, v in item.items() if v is not None and k not in ("id", "status", "type")}


def _as_parts(content: Any) -> list[Any]:
    if isinstance(content, list):
        return list(content)
    if isinstance(content, str) and content:
        return [{"type": "text", "text": content}]
    return []


def merge_assistant_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """serving_responses.py `_merge_consecutive_assistant_messages`: consecutive assistant
    messages of one phase (or a bare reasoning one before) become one message: contents
    joined by a blank line (parts when shapes differ), tool calls and reasoning appended."""
    merged: list[dict[str, Any]] = []
    for msg in messages:
        prev = merged[-1] if merged else None
        if not (
            msg.get("role") == "assistant"
            and prev is not None
            and prev.get("role") == "assistant"
            and (
                prev.get("phase") == msg.get("phase") or set(prev) == {"role", "reasoning_content"}
            )
        ):
            merged.append(msg)
            continue
        prev = merged[-1] = dict(prev)
        if msg.get("phase") is not None:
            prev["phase"] = msg["phase"]
        new_content = msg.get("content")
        if new_content is not None and new_content != "":
            old = prev.get("content")
            if old is None or old == "":
                prev["content"] = new_content
            elif isinstance(old, str) and isinstance(new_content, str):
                prev["content"] = old + "\n\n" + new_content
            else:
                prev["content"] = _as_parts(old) + _as_parts(new_content)
        if msg.get("tool_calls"):
            prev["tool_calls"] = (prev.get("tool_calls") or []) + list(msg["tool_calls"])
        if msg.get("reasoning_content"):
            old_reasoning = prev.get("reasoning_content")
            prev["reasoning_content"] = (
                f"{old_reasoning}\n{msg['reasoning_content']}"
                if old_reasoning
                else msg["reasoning_content"]
            )
    return merged


def coalesce_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """serving_responses.py `_construct_input_messages` (templates without inline system):
    every system message's text joined by a blank line into one leading system message."""
    chunks: list[str] = []
    others: list[dict[str, Any]] = []
    for msg in messages:
        if msg.get("role") != "system":
            others.append(msg)
            continue
        content = msg.get("content")
        if isinstance(content, str):
            chunks.append(content)
        elif isinstance(content, list):
            chunks.extend(
                part["text"]
                for part in content
                if isinstance(part, dict) and isinstance(part.get("text"), str)
            )
    if chunks:
        return [{"role": "system", "content": "\n\n".join(chunks)}, *others]
    return others


def encode_custom_tool_input(payload: str) -> str:
    """responses_adapters.py `encode_custom_tool_input`: the shim call's arguments."""
    return json.dumps({CUSTOM_TOOL_INPUT_KEY: payload}, ensure_ascii=False)


def decode_custom_tool_input(arguments: str) -> str:
    """responses_adapters.py `decode_custom_tool_input`: the payload of a shim call's
    arguments (the only string value of a one-key object, else the raw text)."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(parsed, dict):
        value = parsed.get(CUSTOM_TOOL_INPUT_KEY)
        if isinstance(value, str):
            return value
        if len(parsed) == 1:
            only = next(iter(parsed.values()))
            if isinstance(only, str):
                return only
    return arguments


def custom_tool_description(description: Any, tool_format: Any) -> str | None:
    """responses_adapters.py `custom_tool_description`: the description, then a grammar
    format described (not enforced) to the model."""
    parts = [description] if description else []
    if isinstance(tool_format, dict) and tool_format.get("type") == "grammar":
        syntax = tool_format.get("syntax") or "lark"
        definition = tool_format.get("definition") or ""
        parts.append(f"The payload must conform to this {syntax} grammar:\n{definition}")
    return "\n\n".join(parts) or None


def custom_tool_parameters() -> dict[str, Any]:
    """responses_adapters.py `custom_tool_parameters`: one required string property."""
    return {
        "type": "object",
        "properties": {
            CUSTOM_TOOL_INPUT_KEY: {
                "type": "string",
                "description": "The freeform text payload for this tool.",
            }
        },
        "required": [CUSTOM_TOOL_INPUT_KEY],
        "additionalProperties": False,
    }


def custom_tool_names(request: Mapping[str, Any]) -> set[str]:
    """responses_adapters.py `custom_tool_names`."""
    return {
        tool["name"]
        for tool in request.get("tools") or []
        if isinstance(tool, dict) and tool.get("type") == "custom" and tool.get("name")
    }


def chat_tools(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """serving_responses.py `_response_tools_to_chat_tools`: each function tool as a chat
    tool (`strict` defaults to False, protocol.py `ResponseTool`); a named custom tool as a
    function tool with one string parameter (responses_adapters.py shim)."""
    out = []
    for tool in body.get("tools") or []:
        if tool.get("type") == "function":
            description, parameters = tool.get("description"), tool.get("parameters")
        elif tool.get("type") == "custom" and tool.get("name"):
            description = custom_tool_description(tool.get("description"), tool.get("format"))
            parameters = custom_tool_parameters()
        else:
            continue
        function = {
            "name": tool["name"],
            "description": description,
            "parameters": parameters,
            "strict": bool(tool.get("strict", False)),
        }
        out.append({"type": "function", "function": function})
    return out


def _response_format(text: Any) -> dict[str, Any] | None:
    """protocol.py `_json_schema_from_text_format`: `text.format` json_schema / json_object
    constrain the output; the chat body says it as `response_format`."""
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict):
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema" and fmt.get("schema") is not None:
        schema = {"name": fmt.get("name") or "response", "schema": fmt["schema"]}
        if fmt.get("strict") is not None:
            schema["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": schema}
    return None


def _sampling(body: Mapping[str, Any], defaults: Mapping[str, Any] | None) -> dict[str, Any]:
    """protocol.py `ResponsesRequest.to_sampling_params` in chat fields: max_output_tokens
    less 2 of headroom; temperature/top_p falling back to the engine's defaults, then 0.7 /
    1.0 (only when `defaults` is given: without it the engine applies its own)."""
    out: dict[str, Any] = {}
    max_output = body.get("max_output_tokens")
    if max_output is not None:
        if type(max_output) is not int:
            raise _validation("max_output_tokens: Input should be a valid integer")
        if max_output - 2 < 0:
            raise _invalid(f"max_new_tokens must be at least 0, got {max_output - 2}.")
        out["max_tokens"] = max_output - 2
    for name, fallback in (("temperature", DEFAULT_TEMPERATURE), ("top_p", DEFAULT_TOP_P)):
        value = body.get(name)
        if value is None and defaults is not None:
            value = defaults.get(name, fallback)
        if value is not None:
            out[name] = value
    for name in ("frequency_penalty", "presence_penalty", "top_k", "min_p", "repetition_penalty"):
        if body.get(name) is not None:
            out[name] = body[name]
    return out


def responses_to_chat(
    body: Mapping[str, Any],
    previous: Previous | None,
    *,
    inline_system: bool = False,
    defaults: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The chat body SGLang renders for a Responses request (serving_responses.py
    `_make_request`: `_construct_input_messages`, `_response_tools_to_chat_tools`,
    `_chat_tool_choice`; protocol.py `to_sampling_params`).

    `previous` resolves `previous_response_id` (None outside a session: refused).
    `inline_system`: the chat template keeps system messages where they are (SGLang's
    `supports_inline_system`); otherwise they are coalesced in front. `defaults`: the
    engine's default sampling parameters, if known (see `_sampling`)."""
    if not isinstance(body, Mapping):
        raise _validation("Input should be a valid dictionary")
    _check_request(body)
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    for item in _history(body, previous):
        message = input_item_to_message(item)
        if message is not None:
            messages.append(message)
    messages = merge_assistant_messages(messages)
    if not inline_system:
        messages = coalesce_system(messages)

    tools = chat_tools(body)
    chat: dict[str, Any] = {"messages": messages}
    if body.get("model") is not None:
        chat["model"] = body["model"]
    chat["stream"] = bool(body.get("stream"))
    if tools:
        chat["tools"] = tools
        choice = effective_tool_choice(body)
        # `_chat_tool_choice`: a named tool nests as {"type": "function", "function": {name}}.
        chat["tool_choice"] = (
            {"type": "function", "function": {"name": choice["name"]}}
            if isinstance(choice, dict)
            else choice
        )
    else:
        chat["tool_choice"] = "none"
    parallel = body.get("parallel_tool_calls")
    chat["parallel_tool_calls"] = parallel if parallel is not None else True
    if body.get("stop") is not None:
        chat["stop"] = body["stop"]
    effort = _reasoning_effort(body)
    if effort is not None:
        chat["reasoning_effort"] = effort
    kwargs = body.get("chat_template_kwargs")
    if effort == "none":  # protocol.py `normalize_reasoning_to_thinking`
        kwargs = {"thinking": False, "enable_thinking": False, **(kwargs or {})}
    if kwargs is not None:
        chat["chat_template_kwargs"] = kwargs
    if _include(body, "message.output_text.logprobs"):
        # create_responses' logprob_kwargs: every generated token, top_logprobs or 0.
        chat["logprobs"] = True
        chat["top_logprobs"] = body.get("top_logprobs") or 0
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    chat.update(_sampling(body, defaults))
    return chat


# ---- chat reply -> Responses --------------------------------------------------------------


def _hex() -> str:
    return uuid.uuid4().hex  # sglang utils `random_uuid`


def _reply_parts(
    chat_reply: Mapping[str, Any],
) -> tuple[str | None, str | None, list[dict[str, Any]], Any]:
    """reasoning_content, content, tool calls and finish reason of the first choice (a
    `meta_info.finish_reason` object, when the reply has one, wins: it carries the message
    of an abort)."""
    choices = chat_reply.get("choices") or [{}]
    choice = choices[0]
    message = choice.get("message") or {}
    finish: Any = choice.get("finish_reason")
    meta = choice.get("meta_info")
    if isinstance(meta, dict) and isinstance(meta.get("finish_reason"), dict):
        finish = meta["finish_reason"]
    calls = [call for call in message.get("tool_calls") or [] if isinstance(call, dict)]
    return message.get("reasoning_content"), message.get("content"), calls, finish


def status_from_finish_reason(finish: Any) -> str:
    """serving_responses.py `_status_from_finish_reason`: length -> incomplete, abort or
    error -> failed, else completed."""
    reason = finish.get("type") if isinstance(finish, dict) else finish
    if reason == "length":
        return "incomplete"
    if reason in ("abort", "error"):
        return "failed"
    return "completed"


def _error_from_finish_reason(finish: Any) -> dict[str, Any] | None:
    """serving_responses.py `_error_from_finish_reason`."""
    if status_from_finish_reason(finish) != "failed":
        return None
    message = finish.get("message") if isinstance(finish, dict) else None
    return {"code": "server_error", "message": message or "Generation aborted"}


def _include(request: Mapping[str, Any], value: str) -> bool:
    return value in (request.get("include") or [])


def reasoning_item(
    request: Mapping[str, Any], text: str, item_id: str, status: str | None
) -> dict[str, Any]:
    """serving_responses.py `_make_reasoning_item`: the trace in `content`, mirrored into
    `summary` when `reasoning.summary` is set, `encrypted_content` when included."""
    reasoning = request.get("reasoning")
    wants_summary = isinstance(reasoning, dict) and reasoning.get("summary") is not None
    encrypted = _include(request, "reasoning.encrypted_content")
    return {
        "id": item_id,
        "summary": [{"text": text, "type": "summary_text"}] if wants_summary else [],
        "type": "reasoning",
        "content": [{"text": text, "type": "reasoning_text"}],
        "encrypted_content": encode_reasoning_state(text) if encrypted else None,
        "status": status,
    }


def _output_text(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def output_logprobs(chat_reply: Mapping[str, Any]) -> list[dict[str, Any]]:
    """serving_responses.py `_build_output_text_logprobs` over the chat reply's logprobs:
    each token with `bytes` = its text's UTF-8 (not the engine's bytes), and its top
    logprobs keyed by text as utils.py `to_openai_style_logprobs` keys them (a repeated text
    keeps its first place and its last logprob)."""
    choice = (chat_reply.get("choices") or [{}])[0]
    content = (choice.get("logprobs") or {}).get("content") or []
    out: list[dict[str, Any]] = []
    for entry in content:
        top: dict[str, float] = {}
        for alt in entry.get("top_logprobs") or []:
            top[alt["token"]] = alt["logprob"]
        token = entry["token"]
        out.append(
            {
                "token": token,
                "bytes": list(token.encode("utf-8")),
                "logprob": entry["logprob"],
                "top_logprobs": [
                    {"token": t, "bytes": list(t.encode("utf-8")), "logprob": lp}
                    for t, lp in top.items()
                ],
            }
        )
    return out


def message_item(
    item_id: str,
    text: str,
    status: str,
    phase: str,
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """protocol.py `ResponseOutputMessage` (with SGLang's `phase`)."""
    content = [_output_text(text, logprobs)] if status == "completed" else []
    return {
        "id": item_id,
        "content": content,
        "role": "assistant",
        "status": status,
        "type": "message",
        "phase": phase,
    }


def function_call_item(
    call: Mapping[str, Any], item_id: str, *, arguments: str | None = None, status: str
) -> dict[str, Any]:
    """serving_responses.py `_make_tool_call_item` (function tools): `fc_` id; the call id is
    the chat tool call's (SGLang's format, `call_` + 24 hex) or a fresh one."""
    function = call.get("function") or {}
    call_id = call.get("id") if isinstance(call.get("id"), str) and call.get("id") else None
    return {
        "arguments": (function.get("arguments") or "") if arguments is None else arguments,
        "call_id": call_id or f"call_{_hex()[:24]}",
        "name": function.get("name") or "",
        "type": "function_call",
        "id": item_id,
        "status": status,
    }


def custom_tool_call_item(
    call: Mapping[str, Any], item_id: str, *, payload: str | None = None
) -> dict[str, Any]:
    """serving_responses.py `_make_tool_call_item` (custom tools): `ctc_` id, the freeform
    payload decoded from the shim call's arguments as `input`."""
    function = call.get("function") or {}
    if payload is None:
        payload = decode_custom_tool_input(function.get("arguments") or "")
    call_id = call.get("id") if isinstance(call.get("id"), str) and call.get("id") else None
    return {
        "call_id": call_id or f"call_{_hex()[:24]}",
        "input": payload,
        "name": function.get("name") or "",
        "type": "custom_tool_call",
        "id": item_id,
    }


def _output_items(
    request: Mapping[str, Any], chat_reply: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """serving_responses.py `_output_items`: reasoning, then the message (phase commentary
    when calls follow), then one function_call per tool call."""
    reasoning, content, calls, _ = _reply_parts(chat_reply)
    items: list[dict[str, Any]] = []
    if reasoning:
        items.append(reasoning_item(request, reasoning, f"rs_{_hex()}", "completed"))
    if content:
        phase = "commentary" if calls else "final_answer"
        logprobs = (
            output_logprobs(chat_reply)
            if _include(request, "message.output_text.logprobs")
            else None
        )
        items.append(message_item(f"msg_{_hex()}", content, "completed", phase, logprobs))
    custom = custom_tool_names(request)
    for call in calls:
        if (call.get("function") or {}).get("name") in custom:
            items.append(custom_tool_call_item(call, f"ctc_{_hex()[:8]}"))
        else:
            items.append(function_call_item(call, f"fc_{_hex()[:8]}", status="completed"))
    return items


def _usage(chat_reply: Mapping[str, Any]) -> dict[str, Any]:
    """protocol.py `ResponsesResponse._serialize_usage` over the chat reply's usage."""
    usage = chat_reply.get("usage") or {}
    prompt = int(usage.get("prompt_tokens") or 0)
    completion = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    completion_details = usage.get("completion_tokens_details") or {}
    reasoning = usage.get("reasoning_tokens") or completion_details.get("reasoning_tokens") or 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": int(details.get("cached_tokens") or 0),
            "cache_write_tokens": 0,
        },
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": int(reasoning)},
        "total_tokens": prompt + completion,
    }


def _tool_echo(tool: Mapping[str, Any]) -> dict[str, Any]:
    # protocol.py `ResponseTool` dumped: its fields with their defaults, extras kept.
    fields = ("type", "name", "description", "parameters", "strict", "tools", "defer_loading")
    out = {name: tool.get(name) for name in fields}
    out["strict"] = bool(tool.get("strict", False))
    out["format"] = tool.get("format")
    out.update({k: v for k, v in tool.items() if k not in out})
    return out


def _text_only(output: list[dict[str, Any]]) -> bool:
    return bool(output) and all(
        item["type"] == "message" and all(c["type"] == "output_text" for c in item["content"])
        for item in output
    )


def response_object(
    request: Mapping[str, Any],
    *,
    response_id: str,
    created_at: int,
    model: str | None,
    output: list[dict[str, Any]],
    status: str,
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    """protocol.py `ResponsesResponse.from_request`, dumped: the request echoed around the
    output (`text` is the request's, else {"format": {"type": "text"}} for text-only
    output; `incomplete_details` for an incomplete one)."""
    effort = _reasoning_effort(request)
    text = request.get("text")
    if isinstance(text, dict):
        text = {k: v for k, v in text.items() if v is not None}
    else:
        text = {"format": {"type": "text"}} if _text_only(output) else None
    parallel = request.get("parallel_tool_calls")
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "model": model,
        "output": output,
        "status": status,
        "usage": usage,
        "parallel_tool_calls": parallel if parallel is not None else True,
        "tool_choice": effective_tool_choice(request),
        "tools": [_tool_echo(tool) for tool in request.get("tools") or []],
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "previous_response_id": request.get("previous_response_id"),
        "reasoning": {
            "effort": effort if effort in ECHOABLE_REASONING_EFFORTS else None,
            "summary": None,
        },
        "store": request.get("store", True),
        "temperature": request.get("temperature"),
        "text": text,
        "top_p": request.get("top_p"),
        "truncation": request.get("truncation", "disabled"),
        "user": request.get("user"),
        "metadata": request.get("metadata") or {},
    }


def response_id_for(request: Mapping[str, Any]) -> str:
    """protocol.py `ResponsesRequest.request_id`: the caller's, else `resp_` + 32 hex."""
    given = request.get("request_id")
    return given if isinstance(given, str) and given else f"resp_{_hex()}"


def chat_reply_to_response(
    chat_reply: Mapping[str, Any],
    request: Mapping[str, Any],
    *,
    response_id: str | None = None,
) -> dict[str, Any]:
    """The Responses object SGLang answers (serving_responses.py `responses_full_generator`)
    for the request whose chat reply this is."""
    _, _, _, finish = _reply_parts(chat_reply)
    output = _output_items(request, chat_reply)
    status = status_from_finish_reason(finish)
    response = response_object(
        request,
        response_id=response_id or response_id_for(request),
        created_at=int(chat_reply.get("created") or time.time()),
        model=request.get("model") or chat_reply.get("model"),
        output=output,
        status=status,
        usage=_usage(chat_reply),
    )
    response["error"] = _error_from_finish_reason(finish)
    return response


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def stored_items(
    request: Mapping[str, Any], response: Mapping[str, Any], previous: Previous | None
) -> list[dict[str, Any]]:
    """What SGLang's `msg_store` keeps for a response (serving_responses.py
    `responses_full_generator`): the request's input history (`_response_input_history`:
    the previous response's items first), then the output items dumped without nulls
    (`model_dump(exclude_none=True)`). A session keeps this per response id and returns it
    from the `previous` callback of the next turn's `responses_to_chat`."""
    history = _history(request, previous)
    return history + [_without_nulls(item) for item in response.get("output") or []]


# ---- stream -------------------------------------------------------------------------------


class _Events:
    """serving_responses.py `_send_event`: numbered events as `event: T\\ndata: JSON\\n\\n`."""

    def __init__(self) -> None:
        self.out: list[bytes] = []

    def send(self, event_type: str, **fields: Any) -> None:
        payload = {**fields, "sequence_number": len(self.out), "type": event_type}
        data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
        self.out.append(f"event: {event_type}\ndata: {data}\n\n".encode())


def _stream_reasoning(
    events: _Events, request: Mapping[str, Any], text: str, index: int
) -> dict[str, Any]:
    """A reasoning item's events: added, part (or summary part) added, one delta, done,
    part done, item done (`_responses_stream_generator_non_harmony`, `_close_reasoning_item`)."""
    reasoning = request.get("reasoning")
    wants_summary = isinstance(reasoning, dict) and reasoning.get("summary") is not None
    item_id = f"rs_{_hex()}"
    added: dict[str, Any] = {
        "id": item_id,
        "summary": [],
        "type": "reasoning",
        "content": [],
        "encrypted_content": None,
        "status": "in_progress",
    }
    at = {"item_id": item_id, "output_index": index}
    events.send("response.output_item.added", item=added, output_index=index)
    if wants_summary:
        part = {"text": "", "type": "summary_text"}
        events.send("response.reasoning_summary_part.added", **at, part=part, summary_index=0)
        events.send("response.reasoning_summary_text.delta", delta=text, **at, summary_index=0)
        events.send("response.reasoning_summary_text.done", **at, summary_index=0, text=text)
        done_part = {"text": text, "type": "summary_text"}
        events.send("response.reasoning_summary_part.done", **at, part=done_part, summary_index=0)
    else:
        part = {"text": "", "type": "reasoning_text"}
        events.send("response.content_part.added", content_index=0, **at, part=part)
        events.send("response.reasoning_text.delta", content_index=0, delta=text, **at)
        events.send("response.reasoning_text.done", content_index=0, **at, text=text)
        done_part = {"text": text, "type": "reasoning_text"}
        events.send("response.content_part.done", content_index=0, **at, part=done_part)
    item = reasoning_item(request, text, item_id, "completed")
    events.send("response.output_item.done", item=item, output_index=index)
    return item


def _stream_message(events: _Events, text: str, index: int, phase: str) -> dict[str, Any]:
    """A message's events (`_emit_normal_text`, `_close_message_item`); its phase is the
    one `responses_stream_generator_non_harmony` settles once it sees what follows."""
    item_id = f"msg_{_hex()}"
    at = {"item_id": item_id, "output_index": index}
    added = message_item(item_id, text, "in_progress", phase)
    events.send("response.output_item.added", item=added, output_index=index)
    events.send("response.content_part.added", content_index=0, **at, part=_output_text(""))
    events.send("response.output_text.delta", content_index=0, delta=text, **at, logprobs=[])
    events.send("response.output_text.done", content_index=0, **at, logprobs=[], text=text)
    events.send("response.content_part.done", content_index=0, **at, part=_output_text(text))
    item = message_item(item_id, text, "completed", phase)
    events.send("response.output_item.done", item=item, output_index=index)
    return item


def _stream_call(events: _Events, call: Mapping[str, Any], index: int) -> dict[str, Any]:
    """A function call's events (`_emit_tool_calls`, `_close_tool_call_state`): added with
    empty arguments, one arguments delta (none when empty), done (with the name), item done."""
    item_id = f"fc_{_hex()[:8]}"
    added = function_call_item(call, item_id, arguments="", status="in_progress")
    item = {**added, "arguments": (call.get("function") or {}).get("arguments") or ""}
    item["status"] = "completed"
    at = {"item_id": item_id, "output_index": index}
    events.send("response.output_item.added", item=added, output_index=index)
    if item["arguments"]:
        events.send("response.function_call_arguments.delta", delta=item["arguments"], **at)
    events.send(
        "response.function_call_arguments.done",
        arguments=item["arguments"],
        **at,
        name=item["name"],
    )
    events.send("response.output_item.done", item=item, output_index=index)
    return item


def _stream_custom_call(events: _Events, call: Mapping[str, Any], index: int) -> dict[str, Any]:
    """A custom tool call's events (`_emit_tool_calls`, `_close_tool_call_state`): added
    with empty input, one input delta (none when empty), input done, item done."""
    item_id = f"ctc_{_hex()[:8]}"
    added = custom_tool_call_item(call, item_id, payload="")
    item = {**added, "input": custom_tool_call_item(call, item_id)["input"]}
    at = {"item_id": item_id, "output_index": index}
    events.send("response.output_item.added", item=added, output_index=index)
    if item["input"]:
        events.send("response.custom_tool_call_input.delta", delta=item["input"], **at)
    events.send("response.custom_tool_call_input.done", input=item["input"], **at)
    events.send("response.output_item.done", item=item, output_index=index)
    return item


def response_stream_events(
    chat_reply: Mapping[str, Any],
    request: Mapping[str, Any],
    *,
    response_id: str | None = None,
) -> list[bytes]:
    """The SSE events SGLang streams for this result (serving_responses.py
    `responses_stream_generator_non_harmony`): response.created and response.in_progress
    (status in_progress, no output), then each output item's events in order (reasoning,
    message, function calls), then `response.<status>` with the whole response. No
    `[DONE]` line follows (SGLang sends none on this route)."""
    reasoning, content, calls, finish = _reply_parts(chat_reply)
    response_id = response_id or response_id_for(request)
    created_at = int(chat_reply.get("created") or time.time())
    model = request.get("model") or chat_reply.get("model")
    events = _Events()
    initial = response_object(
        request,
        response_id=response_id,
        created_at=created_at,
        model=model,
        output=[],
        status="in_progress",
        usage=None,
    )
    events.send("response.created", response=initial)
    events.send("response.in_progress", response=initial)
    output: list[dict[str, Any]] = []
    if reasoning:
        output.append(_stream_reasoning(events, request, reasoning, len(output)))
    if content:
        phase = "commentary" if calls else "final_answer"
        output.append(_stream_message(events, content, len(output), phase))
    custom = custom_tool_names(request)
    for call in calls:
        if (call.get("function") or {}).get("name") in custom:
            output.append(_stream_custom_call(events, call, len(output)))
        else:
            output.append(_stream_call(events, call, len(output)))
    status = status_from_finish_reason(finish)
    final = response_object(
        request,
        response_id=response_id,
        created_at=created_at,
        model=model,
        output=output,
        status=status,
        usage=_usage(chat_reply),
    )
    final["error"] = _error_from_finish_reason(finish)
    events.send(f"response.{status}", response=final)
    return events.out


# ---- the session route's dialect ----------------------------------------------------------


def session_response_id(chat_reply: Mapping[str, Any]) -> str:
    """A session turn's response id: `resp_` + the engine's chat reply id (SGLang's `rid`,
    32 hex), so the id is the record's and the same however often the reply is rebuilt."""
    rid = chat_reply.get("id")
    return f"resp_{rid}" if isinstance(rid, str) and rid else f"resp_{_hex()}"


def own_items(request: Mapping[str, Any], response: Mapping[str, Any]) -> list[dict[str, Any]]:
    """What one response adds to the stored history: its request's own input items, then its
    output items (`stored_items` without the previous response's)."""
    alone = {k: v for k, v in request.items() if k != "previous_response_id"}
    return stored_items(alone, response, None)


def resent_as_returned(chat: dict[str, Any]) -> dict[str, Any]:
    """A session's chat body with each resent assistant message's text parts (an
    `output_text` item becomes `[{"type": "text", ...}]`) joined back into the one string the
    engine returned and the session stored, so the history matches what was recorded (the
    prompt ids never come from a re-render). SGLang itself joins text parts only for
    templates that take string content (`process_content_for_template_format`)."""
    for message in chat.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if message.get("role") == "assistant" and isinstance(content, list):
            if all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                message["content"] = "".join(str(p.get("text", "")) for p in content)
    return chat


class ResponsesDialect:
    """The `Dialect` of `POST /sessions/{id}/v1/responses` (sessiongate.dialects):
    `previous_response_id` resolves to the session's own earlier responses (`history`)."""

    name = "responses"
    # Under --stream-upstream relay the engine's chat chunks become events as they arrive.
    relays_streams = True

    def to_chat(self, body: dict[str, Any], history: Previous | None = None) -> dict[str, Any]:
        return resent_as_returned(responses_to_chat(body, history))

    def from_chat(self, chat_reply: dict[str, Any], request: dict[str, Any]) -> bytes:
        response = chat_reply_to_response(
            chat_reply, request, response_id=session_response_id(chat_reply)
        )
        return _compact(response)

    def stream_events(self, chat_reply: dict[str, Any], request: dict[str, Any]) -> bytes:
        rid = session_response_id(chat_reply)
        return b"".join(response_stream_events(chat_reply, request, response_id=rid))

    def stream_relay(self, request: dict[str, Any], prompt_tokens: int) -> ResponseStreamRelay:
        from sessiongate.dialects.responses_stream import ResponseStreamRelay

        return ResponseStreamRelay(request)

    def error_body(self, status: int, message: str, error_type: str | None = None) -> bytes:
        kind = error_type or ("Not Found" if status == 404 else "Bad Request")
        return _compact(error_body(DialectError(status, kind, message)))

    def engine_error(self, status: int, body: bytes) -> bytes:
        # The engine's chat error, its message kept, in this route's envelope.
        message = body.decode("utf-8", "replace")
        try:
            document = json.loads(body)
        except ValueError:
            document = None
        if isinstance(document, dict):
            found = document.get("message") or document.get("error")
            if isinstance(found, dict):
                found = found.get("message")
            if isinstance(found, str):
                message = found
        return self.error_body(status, message, "Internal Server Error" if status >= 500 else None)


def _compact(document: object) -> bytes:
    return json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode()


RESPONSES = ResponsesDialect()

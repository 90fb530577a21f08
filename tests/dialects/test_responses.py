"""Conformance of the OpenAI Responses dialect (sessiongate.dialects.responses) to SGLang
0.5.23's `/v1/responses`: each test restates one rule of
`sglang/srt/entrypoints/openai/serving_responses.py` (or `protocol.py`,
`responses_adapters.py`, `http_server.py`) and names it; the outputs are parsed with the
real `openai` SDK's types."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from sessiongate.dialects.errors import DialectError
from sessiongate.dialects.responses import (
    chat_reply_to_response,
    decode_reasoning_state,
    encode_reasoning_state,
    error_body,
    response_stream_events,
    responses_to_chat,
    stored_items,
)

TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def chat_reply(
    content: str | None = "Sunny.",
    reasoning: str | None = None,
    calls: list[dict[str, Any]] | None = None,
    finish: str = "stop",
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "m",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {
            "prompt_tokens": 11,
            "completion_tokens": 7,
            "total_tokens": 18,
            "reasoning_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": 4},
        },
    }


CALL = {
    "id": "call_0123456789abcdef01234567",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}


def refused(body: dict[str, Any], previous: Any = None) -> DialectError:
    with pytest.raises(DialectError) as info:
        responses_to_chat(body, previous)
    return info.value


# ---- request -> chat ----------------------------------------------------------------------


def test_string_input_is_one_user_message() -> None:
    """serving_responses.py `_response_input_history`: a string input is a user message."""
    chat = responses_to_chat({"model": "m", "input": "Hi"}, None)
    assert chat["messages"] == [{"role": "user", "content": "Hi"}]
    assert chat["model"] == "m" and chat["stream"] is False


def test_no_tools_sends_tool_choice_none() -> None:
    """serving_responses.py `_make_request`: tool_choice="none" when there are no chat tools;
    parallel_tool_calls defaults to True."""
    chat = responses_to_chat({"input": "Hi"}, None)
    assert chat["tool_choice"] == "none" and "tools" not in chat
    assert chat["parallel_tool_calls"] is True


def test_instructions_and_developer_coalesce_into_one_system() -> None:
    """serving_responses.py `_construct_input_messages`: instructions lead as system; a
    developer message becomes system labelled "Developer instructions:"
    (responses_adapters.py `label_developer_content`); without inline system support every
    system text joins, by a blank line, one leading system message."""
    body = {
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": "Hi"},
            {"role": "developer", "content": "Use metric units."},
        ],
    }
    assert responses_to_chat(body, None)["messages"] == [
        {"role": "system", "content": "Be brief.\n\nDeveloper instructions:\nUse metric units."},
        {"role": "user", "content": "Hi"},
    ]
    inline = responses_to_chat(body, None, inline_system=True)["messages"]
    assert [m["role"] for m in inline] == ["system", "user", "system"]


def test_message_items_and_text_parts() -> None:
    """`_normalize_response_message_for_chat` / `_normalize_response_content_part_for_chat`:
    input_text and output_text parts become text parts; id, status and type are dropped."""
    body = {
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Q"}]},
            {
                "type": "message",
                "id": "msg_1",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "A", "annotations": []}],
            },
        ]
    }
    assert responses_to_chat(body, None)["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Q"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A"}]},
    ]


def test_function_call_and_output_items() -> None:
    """`_normalize_response_message_for_chat`: function_call -> assistant tool_calls (id =
    call_id, arguments a JSON-object string, "{}" when not one); function_call_output ->
    a tool message (list outputs flattened, `_flatten_tool_output`)."""
    body = {
        "input": [
            {"role": "user", "content": "Weather?"},
            {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "[1]"},
            {"type": "function_call_output", "call_id": "call_1", "output": [{"text": "ok"}]},
        ]
    }
    messages = responses_to_chat(body, None)["messages"]
    assert messages[1] == {
        "role": "assistant",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }
    assert messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": "ok"}


def test_reasoning_message_and_calls_merge_into_one_assistant_turn() -> None:
    """`_merge_consecutive_assistant_messages`: a reasoning item, the message and the calls of
    one turn render as one assistant message."""
    body = {
        "input": [
            {"role": "user", "content": "Q"},
            {
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "r"}],
            },
            {"type": "message", "role": "assistant", "content": "A"},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        ]
    }
    merged = responses_to_chat(body, None)["messages"][1]
    assert merged["reasoning_content"] == "r" and merged["content"] == "A"
    assert [call["id"] for call in merged["tool_calls"]] == ["c"]


def test_reasoning_summary_wins_and_encrypted_content_restores() -> None:
    """`_normalize_response_message_for_chat` (reasoning): summary texts before content
    texts; a bare `encrypted_content` (responses_adapters.py `encode_reasoning_state`) is
    decoded; an empty item is dropped."""
    blob = encode_reasoning_state("hidden")
    assert decode_reasoning_state(blob) == "hidden"
    body = {
        "input": [
            {"type": "reasoning", "summary": [{"text": "s"}], "content": [{"text": "c"}]},
            {"role": "user", "content": "x"},
            {"type": "reasoning", "summary": [], "encrypted_content": blob},
            {"role": "user", "content": "y"},
            {"type": "reasoning", "summary": []},
        ]
    }
    messages = responses_to_chat(body, None)["messages"]
    assert messages[0] == {"role": "assistant", "reasoning_content": "s"}
    assert messages[2] == {"role": "assistant", "reasoning_content": "hidden"}
    assert len(messages) == 4


def test_function_tools_and_tool_choice() -> None:
    """`_response_tools_to_chat_tools` (strict defaults to False) and `_chat_tool_choice`:
    a named tool nests as {"type": "function", "function": {"name"}}."""
    body = {
        "input": "x",
        "tools": [TOOL],
        "tool_choice": {"type": "function", "name": TOOL["name"]},
    }
    chat = responses_to_chat(body, None)
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather of a city",
                "parameters": TOOL["parameters"],
                "strict": False,
            },
        }
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    other = {"input": "x", "tools": [TOOL], "tool_choice": {"type": "mcp", "server_label": "s"}}
    assert responses_to_chat(other, None)["tool_choice"] == "auto"  # effective_tool_choice


def test_sampling_parameters() -> None:
    """protocol.py `to_sampling_params`: max_output_tokens less 2 of headroom; temperature and
    top_p as given, else the engine defaults, else 0.7 / 1.0."""
    chat = responses_to_chat({"input": "x", "max_output_tokens": 100, "temperature": 0.2}, None)
    assert chat["max_tokens"] == 98 and chat["temperature"] == 0.2 and "top_p" not in chat
    with_defaults = responses_to_chat({"input": "x"}, None, defaults={"temperature": 0.6})
    assert with_defaults["temperature"] == 0.6 and with_defaults["top_p"] == 1.0
    assert responses_to_chat({"input": "x"}, None, defaults={})["temperature"] == 0.7


def test_reasoning_effort_none_turns_thinking_off() -> None:
    """protocol.py `normalize_reasoning_to_thinking` (an explicit kwarg wins) and
    `ResponseReasoningParam` (effort defaults to "medium")."""
    body = {
        "input": "x",
        "reasoning": {"effort": "none"},
        "chat_template_kwargs": {"thinking": True},
    }
    chat = responses_to_chat(body, None)
    assert chat["chat_template_kwargs"] == {"thinking": True, "enable_thinking": False}
    assert responses_to_chat({"input": "x", "reasoning": {}}, None)["reasoning_effort"] == "medium"


def test_text_format_json_schema_is_response_format() -> None:
    """protocol.py `_json_schema_from_text_format`: text.format constrains the output."""
    schema = {"type": "object"}
    body = {
        "input": "x",
        "text": {"format": {"type": "json_schema", "name": "a", "schema": schema}},
    }
    assert responses_to_chat(body, None)["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "a", "schema": schema},
    }


def test_previous_response_id_is_resolved_by_the_session() -> None:
    """`_response_input_history`: the stored items of previous_response_id come first."""
    stored = [
        {"role": "user", "content": "Q"},
        {"type": "message", "role": "assistant", "content": "A"},
    ]
    seen: list[str] = []

    def previous(response_id: str) -> list[dict[str, Any]]:
        seen.append(response_id)
        return stored

    chat = responses_to_chat({"input": "Again", "previous_response_id": "resp_1"}, previous)
    assert seen == ["resp_1"]
    assert [m["content"] for m in chat["messages"]] == ["Q", "A", "Again"]


def test_previous_response_id_errors() -> None:
    """Outside a session: 400 naming the field; `_make_invalid_id_error` (no resp_ prefix)
    and `_make_not_found_error` (404) as SGLang words them."""
    assert refused({"input": "x", "previous_response_id": "resp_1"}).param == "previous_response_id"

    def previous(response_id: str) -> list[dict[str, Any]]:
        raise KeyError(response_id)

    bad = refused({"input": "x", "previous_response_id": "abc"}, previous)
    assert bad.message == "Invalid 'response_id': 'abc'. Expected an ID that begins with 'resp'."
    missing = refused({"input": "x", "previous_response_id": "resp_2"}, previous)
    assert (missing.status, missing.message) == (404, "Response with id 'resp_2' not found.")


@pytest.mark.parametrize(
    "tool_type",
    [
        "web_search",
        "web_search_preview",
        "file_search",
        "code_interpreter",
        "computer_use_preview",
        "mcp",
        "image_generation",
        "local_shell",
        "namespace",
    ],
)
def test_builtin_tools_are_refused(tool_type: str) -> None:
    """Built-in tools run server-side in SGLang (`_generate_with_builtin_tools`, tool_server);
    namespace tools need the muse parser: refused, naming the type."""
    error = refused({"input": "x", "tools": [{"type": tool_type, "name": "t"}]})
    assert (error.status, error.param) == (400, "tools") and repr(tool_type) in error.message


APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Apply a patch",
    "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
}
PATCH_CALL = {
    "id": "call_abcdefabcdefabcdefabcdef",
    "type": "function",
    "function": {"name": "apply_patch", "arguments": '{"input": "*** Begin Patch\\n"}'},
}


def test_custom_tools_go_through_the_string_shim() -> None:
    """`_response_tools_to_chat_tools` + responses_adapters.py `custom_tool_parameters` /
    `custom_tool_description`: a custom tool is a function tool with one string property
    `input`, its grammar described; a replayed custom_tool_call is a call whose arguments
    are `encode_custom_tool_input(input)`; its output a tool message."""
    body = {
        "input": [
            {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "p"},
            {"type": "custom_tool_call_output", "call_id": "c1", "output": "done"},
        ],
        "tools": [APPLY_PATCH],
        "tool_choice": {"type": "custom", "name": "apply_patch"},
    }
    chat = responses_to_chat(body, None)
    function = chat["tools"][0]["function"]
    assert function["description"] == (
        "Apply a patch\n\nThe payload must conform to this lark grammar:\nstart: /.+/"
    )
    assert function["parameters"]["required"] == ["input"]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "apply_patch"}}
    call, output = chat["messages"]
    assert call["tool_calls"][0]["function"]["arguments"] == '{"input": "p"}'
    assert output == {"role": "tool", "tool_call_id": "c1", "content": "done"}


def test_custom_tool_call_output_item_and_events() -> None:
    """`_make_tool_call_item` (custom): a custom_tool_call with the decoded payload
    (`decode_custom_tool_input`); streamed as added, custom_tool_call_input.delta / .done,
    item done."""
    request = {"model": "m", "input": "fix it", "tools": [APPLY_PATCH]}
    out = chat_reply_to_response(chat_reply(None, calls=[PATCH_CALL], finish="tool_calls"), request)
    (item,) = Response.model_validate(out).output
    assert item.type == "custom_tool_call" and item.input == "*** Begin Patch\n"
    assert item.call_id == PATCH_CALL["id"] and (item.id or "").startswith("ctc_")
    events = parse_events(
        response_stream_events(chat_reply(None, calls=[PATCH_CALL], finish="tool_calls"), request)
    )
    assert [e["type"] for e in events][2:] == [
        "response.output_item.added",
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[4]["input"] == "*** Begin Patch\n"


def test_shell_tool_refused_as_sglang_words_it() -> None:
    """`create_responses`: shell tools -> "Shell tools are not supported by this model"."""
    assert refused({"input": "x", "tools": [{"type": "shell"}]}).message == (
        "Shell tools are not supported by this model"
    )


def test_other_refusals() -> None:
    """background (SGLang needs its response store), unknown input item types
    (`_normalize_response_message_for_chat`'s ValueError, rendered "{e} {e.__cause__}"),
    media parts, logprobs in streaming (`create_responses`), tool_choice rules."""
    assert refused({"input": "x", "background": True}).param == "background"
    odd = refused({"input": [{"type": "item_reference", "id": "x"}]})
    assert odd.message == "Unsupported Responses API input item type: 'item_reference' None"
    image = {"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}
    assert "input_image" in refused({"input": [image]}).message
    stream = {"input": "x", "stream": True, "include": ["message.output_text.logprobs"]}
    assert refused(stream).message == "logprobs are not supported in streaming mode"
    assert (
        "requires at least one tool" in refused({"input": "x", "tool_choice": "required"}).message
    )
    named = {"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}
    assert refused(named).message == "Tool 'nope' is not declared in tools"
    assert refused({"input": 3}).error_type == "Bad Request"
    assert refused({"input": "x", "tool_choice": "any"}).error_type == "Bad Request"


def test_error_envelope() -> None:
    """serving_responses.py `create_error_response`: {"error": {message, type, param, code}}."""
    error = DialectError(400, "invalid_request_error", "bad", "tools")
    assert error_body(error) == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "tools", "code": 400}
    }


# ---- chat reply -> Responses --------------------------------------------------------------


def test_text_reply_is_an_sdk_response() -> None:
    """`responses_full_generator` + protocol.py `ResponsesResponse.from_request`: one message
    (phase final_answer), the request echoed, usage in the Responses shape."""
    request = {"model": "m", "input": "Hi", "temperature": 0.5, "metadata": {"k": "v"}}
    out = chat_reply_to_response(chat_reply(), request)
    parsed = Response.model_validate(out)
    assert parsed.output_text == "Sunny." and parsed.status == "completed"
    assert out["id"].startswith("resp_") and out["created_at"] == 1700000000
    assert out["output"][0]["phase"] == "final_answer"
    assert out["text"] == {"format": {"type": "text"}} and out["metadata"] == {"k": "v"}
    assert out["usage"] == {
        "input_tokens": 11,
        "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
        "output_tokens": 7,
        "output_tokens_details": {"reasoning_tokens": 3},
        "total_tokens": 18,
    }
    assert out["reasoning"] == {"effort": None, "summary": None}


def test_reasoning_message_and_call_items() -> None:
    """`_output_items`: reasoning, message (phase commentary when calls follow), then
    function_call items (`_make_tool_call_item`: fc_ id, call_id, name, arguments)."""
    request = {"model": "m", "input": "Hi", "tools": [TOOL], "reasoning": {"summary": "auto"}}
    out = chat_reply_to_response(
        chat_reply("Let me check.", "think", [CALL], "tool_calls"), request
    )
    parsed = Response.model_validate(out)
    assert [item.type for item in parsed.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = out["output"]
    assert reasoning["summary"] == [{"text": "think", "type": "summary_text"}]
    assert message["phase"] == "commentary" and out["text"] is None
    assert call["call_id"] == CALL["id"] and call["id"].startswith("fc_")
    assert (call["name"], call["arguments"], call["status"]) == (
        "get_weather",
        '{"city": "Paris"}',
        "completed",
    )
    assert out["status"] == "completed" and out["tools"][0]["strict"] is False


def test_encrypted_reasoning_when_included() -> None:
    """`_make_reasoning_item`: include reasoning.encrypted_content -> the encoded trace."""
    request = {"input": "x", "include": ["reasoning.encrypted_content"]}
    item = chat_reply_to_response(chat_reply("A", "deep"), request)["output"][0]
    assert decode_reasoning_state(item["encrypted_content"]) == "deep"


def test_output_text_logprobs_when_included() -> None:
    """create_responses' logprob_kwargs (chat logprobs with top_logprobs or 0) and
    `_build_output_text_logprobs`: bytes are the token text's UTF-8, top logprobs keyed by
    text (utils.py `to_openai_style_logprobs`)."""
    request = {"input": "x", "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    chat = responses_to_chat(request, None)
    assert (chat["logprobs"], chat["top_logprobs"]) == (True, 2)
    reply = chat_reply("Hi")
    reply["choices"][0]["logprobs"] = {
        "content": [
            {
                "token": "Hi",
                "logprob": -0.5,
                "bytes": [72, 105],
                "top_logprobs": [
                    {"token": "Hi", "logprob": -0.5, "bytes": [72, 105]},
                    {"token": "\ufffd", "logprob": -3.0, "bytes": [226]},
                    {"token": "\ufffd", "logprob": -4.0, "bytes": [227]},
                ],
            }
        ]
    }
    out = chat_reply_to_response(reply, {**request, "model": "m"})
    logprobs = Response.model_validate(out).output[0].content[0].logprobs  # type: ignore[union-attr]
    assert logprobs is not None and logprobs[0].bytes == [72, 105]
    assert [(t.token, t.logprob, t.bytes) for t in logprobs[0].top_logprobs] == [
        ("Hi", -0.5, [72, 105]),
        ("\ufffd", -4.0, [239, 191, 189]),
    ]
    assert (
        chat_reply_to_response(reply, {"input": "x"})["output"][0]["content"][0]["logprobs"] is None
    )


@pytest.mark.parametrize(
    ("finish", "status"), [("length", "incomplete"), ("abort", "failed"), ("stop", "completed")]
)
def test_status_from_finish_reason(finish: str, status: str) -> None:
    """`_status_from_finish_reason`, `_error_from_finish_reason` and `from_request`'s
    incomplete_details."""
    out = chat_reply_to_response(chat_reply(finish=finish), {"input": "x", "model": "m"})
    Response.model_validate(out)
    assert out["status"] == status
    assert (out["incomplete_details"] is not None) == (status == "incomplete")
    assert (out["error"] is not None) == (status == "failed")


def test_store_false_client_resends_the_output() -> None:
    """A store=false client sends the previous output items back as input. SGLang's merge
    (`_merge_consecutive_assistant_messages`) joins the reasoning into the message, but the
    function_call item (no phase) does not join a message of phase "commentary": the calls
    render as an assistant message of their own, exactly as SGLang renders them."""
    request = {"model": "m", "input": "Weather?", "tools": [TOOL], "store": False}
    first = chat_reply_to_response(chat_reply("Checking.", "think", [CALL], "tool_calls"), request)
    second = {
        **request,
        "input": [
            {"role": "user", "content": "Weather?"},
            *first["output"],
            {"type": "function_call_output", "call_id": CALL["id"], "output": "sunny"},
        ],
    }
    messages = responses_to_chat(second, None)["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "assistant", "tool"]
    turn, calls = messages[1], messages[2]
    assert turn["reasoning_content"] == "think" and turn["phase"] == "commentary"
    assert turn["content"] == [{"type": "text", "text": "Checking."}]
    assert calls["tool_calls"][0]["id"] == CALL["id"]
    assert json.loads(calls["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    # Without a message, the reasoning and the call are one assistant message.
    bare = chat_reply_to_response(chat_reply(None, "think", [CALL], "tool_calls"), request)
    third = {**request, "input": [{"role": "user", "content": "Weather?"}, *bare["output"]]}
    (merged,) = responses_to_chat(third, None)["messages"][1:]
    assert merged["reasoning_content"] == "think" and len(merged["tool_calls"]) == 1


def test_stored_items_chain_previous_response_ids() -> None:
    """`responses_full_generator` stores `_response_input_history(request)` + the output
    dumped with exclude_none; the next turn's previous_response_id renders all of it."""
    store: dict[str, list[dict[str, Any]]] = {}
    first_request = {"model": "m", "input": "Q1"}
    first = chat_reply_to_response(chat_reply("A1"), first_request)
    store[first["id"]] = stored_items(first_request, first, store.__getitem__)
    assert store[first["id"]][1]["content"] == [
        {"annotations": [], "text": "A1", "type": "output_text"}
    ]
    second_request = {"model": "m", "input": "Q2", "previous_response_id": first["id"]}
    second = chat_reply_to_response(chat_reply("A2"), second_request)
    store[second["id"]] = stored_items(second_request, second, store.__getitem__)
    third = {"model": "m", "input": "Q3", "previous_response_id": second["id"]}
    messages = responses_to_chat(third, store.__getitem__)["messages"]
    texts = [
        m["content"] if isinstance(m["content"], str) else m["content"][0]["text"] for m in messages
    ]
    assert texts == ["Q1", "A1", "Q2", "A2", "Q3"]


# ---- stream -------------------------------------------------------------------------------


def parse_events(events: list[bytes]) -> list[dict[str, Any]]:
    payloads = []
    for raw in events:
        text = raw.decode()
        head, data = text.split("\n", 1)
        assert text.endswith("\n\n") and data.startswith("data: ")
        payload = json.loads(data[len("data: ") :])
        assert head == f"event: {payload['type']}"
        EVENTS.validate_python(payload)  # the SDK's event union parses it
        payloads.append(payload)
    return payloads


def test_stream_events_of_reasoning_message_and_call() -> None:
    """`responses_stream_generator_non_harmony`: created, in_progress, then per item added /
    part added / delta / done / part done / item done (function calls: added, arguments
    delta, arguments done, item done), then response.completed; sequence numbers 0..n-1."""
    request = {"model": "m", "input": "Hi", "tools": [TOOL], "stream": True}
    events = parse_events(
        response_stream_events(chat_reply("Let me check.", "think", [CALL], "tool_calls"), request)
    )
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert (
        events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    )
    assert events[8]["item"]["phase"] == "commentary"  # a tool call follows the message
    assert events[16]["name"] == "get_weather"
    final = Response.model_validate(events[-1]["response"])
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert final.id == events[0]["response"]["id"]


def test_stream_summary_events_and_incomplete_end() -> None:
    """With reasoning.summary the trace streams as reasoning_summary_* events; a length stop
    ends with response.incomplete."""
    request = {"input": "Hi", "reasoning": {"summary": "auto"}, "model": "m"}
    events = parse_events(response_stream_events(chat_reply("A", "r", finish="length"), request))
    types = [e["type"] for e in events]
    assert "response.reasoning_summary_text.delta" in types
    assert "response.reasoning_text.delta" not in types
    assert types[-1] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}

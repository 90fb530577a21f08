"""Conformance of the Anthropic dialect with SGLang 0.5.23's `/v1/messages`.

Each test names the SGLang function it restates (sglang/srt/entrypoints/anthropic/serving.py
unless said otherwise); the expected chat bodies are what that function builds.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import pytest
from anthropic._models import construct_type

from sessiongate.dialects import CHAT, DialectError
from sessiongate.dialects.anthropic import (
    ANTHROPIC,
    EngineTraits,
    chat_reply_to_message,
    check_tool_links,
    engine_error_to_envelope,
    error_envelope,
    message_stream_events,
    messages_to_chat,
)


def body(**extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "hi"}],
        **extra,
    }


def refused(document: dict[str, Any], traits: EngineTraits | None = None) -> DialectError:
    with pytest.raises(DialectError) as caught:
        messages_to_chat(document, traits)
    assert caught.value.status == 400
    assert caught.value.error_type == "invalid_request_error"
    return caught.value


def test_plain_request_maps_the_sampling_members() -> None:
    """`_convert_to_chat_completion_request`: request_data, stop_sequences -> stop."""
    chat = messages_to_chat(
        body(temperature=0.5, top_p=0.9, top_k=4, stop_sequences=["x"], metadata={"user_id": "u"})
    )
    assert chat == {
        "messages": [{"role": "user", "content": "hi"}],
        "model": "m",
        "max_tokens": 16,
        "stream": False,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 4,
        "stop": ["x"],
    }


def test_stream_asks_for_usage() -> None:
    """`_convert_to_chat_completion_request`: StreamOptions(include_usage, continuous)."""
    chat = messages_to_chat(body(stream=True))
    assert chat["stream"] is True
    assert chat["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


def test_system_string_and_blocks_become_one_system_message() -> None:
    """`_convert_to_chat_completion_request`: system_parts joined with "\\n"."""
    chat = messages_to_chat(
        body(system=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])
    )
    assert chat["messages"][0] == {"role": "system", "content": "a\nb"}
    assert messages_to_chat(body(system="  "))["messages"][0]["role"] == "user"


def test_inline_system_merges_only_when_the_template_cannot_place_it() -> None:
    """`_extract_system_text` under `_merge_inline_system` (not supports_inline_system)."""
    document = body(
        system="top",
        messages=[{"role": "system", "content": " inline "}, {"role": "user", "content": "q"}],
    )
    merged = messages_to_chat(document, EngineTraits(merge_inline_system=True))["messages"]
    assert merged == [
        {"role": "system", "content": "top\ninline"},
        {"role": "user", "content": "q"},
    ]
    kept = messages_to_chat(document)["messages"]
    assert kept[1] == {"role": "system", "content": " inline "}


def agent_history() -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "need a tool", "signature": "s"},
                {"type": "text", "text": "checking"},
                {"type": "tool_use", "id": "call_1", "name": "get", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "before"},
                {"type": "tool_result", "tool_use_id": "call_1", "content": "sunny"},
                {"type": "text", "text": "after"},
            ],
        },
    ]


def test_blocks_become_chat_messages_in_wire_order() -> None:
    """`_convert_to_chat_completion_request`: thinking -> reasoning_content (native
    history), tool_use -> tool_calls (json.dumps of input), tool_result -> a tool message
    between the text before it (flushed, `_emit_user_message`) and after it."""
    chat = messages_to_chat(body(messages=agent_history()))
    assert chat["messages"] == [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "reasoning_content": "need a tool",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get", "arguments": '{"city": "Paris"}'},
                }
            ],
            "content": "checking",
        },
        {"role": "user", "content": "before"},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": "after"},
    ]


def test_thinking_history_is_wrapped_or_dropped_without_native_support() -> None:
    """`_convert_assistant_thinking_blocks` with `wrap_reasoning_history`, or no detector."""
    wrapped = EngineTraits(native_reasoning_history=False)
    assistant = messages_to_chat(body(messages=agent_history()), wrapped)["messages"][1]
    assert assistant["content"] == [
        {"type": "text", "text": "<think>need a tool\n</think>"},
        {"type": "text", "text": "checking"},
    ]
    dropped = EngineTraits(native_reasoning_history=False, reasoning_wrap=None)
    assistant = messages_to_chat(body(messages=agent_history()), dropped)["messages"][1]
    assert assistant["content"] == "checking" and "reasoning_content" not in assistant


def test_redacted_thinking_is_refused() -> None:
    """`_convert_assistant_thinking_blocks`: redacted_thinking raises (400)."""
    messages = [{"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}]
    assert "redacted_thinking" in refused(body(messages=messages)).message


def test_tool_result_lists_images_and_references() -> None:
    """`_convert_tool_result_content`: text, base64 images, reference runs split apart."""
    content = [
        {"type": "text", "text": "a"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "Zg=="}},
        {"type": "tool_reference", "tool_name": "t"},
        {"type": "text", "text": "b"},
    ]
    messages = [
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "c", "content": content}],
        }
    ]
    chat = messages_to_chat(body(messages=messages))["messages"]
    assert chat == [
        {
            "role": "tool",
            "tool_call_id": "c",
            "content": [
                {"type": "text", "text": "a"},
                {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,Zg=="}},
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": [{"type": "tool_reference", "name": "t"}]},
        {"role": "tool", "tool_call_id": "c", "content": "b"},
    ]


def test_empty_assistant_keeps_a_placeholder_and_tool_only_user_vanishes() -> None:
    """`_convert_to_chat_completion_request`: "" placeholder; user of tool_results only."""
    messages = [
        {"role": "assistant", "content": []},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x"}]},
    ]
    chat = messages_to_chat(body(messages=messages))["messages"]
    assert chat == [
        {"role": "assistant", "content": ""},
        {"role": "tool", "tool_call_id": "x", "content": ""},
    ]


def test_tools_and_tool_choice() -> None:
    """`_convert_to_chat_completion_request`: custom tools as functions (type object added,
    server tools skipped), tool_choice any -> required, tool -> function, parallel flag."""
    tools = [
        {"name": "get", "input_schema": {"properties": {}}, "description": "d"},
        {"type": "web_search_20250305", "name": "web_search"},
    ]
    chat = messages_to_chat(
        body(
            tools=tools,
            tool_choice={"type": "tool", "name": "get", "disable_parallel_tool_use": True},
        )
    )
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get",
                "description": "d",
                "parameters": {"properties": {}, "type": "object"},
                "strict": False,
            },
        }
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get"}}
    assert chat["parallel_tool_calls"] is False
    assert messages_to_chat(body(tools=tools))["tool_choice"] == "auto"
    assert (
        messages_to_chat(body(tools=tools, tool_choice={"type": "any"}))["tool_choice"]
        == "required"
    )
    assert (
        "requires at least one custom tool"
        in refused(body(tools=tools[1:], tool_choice={"type": "any"})).message
    )
    assert (
        "not in the forwarded tools"
        in refused(body(tools=tools, tool_choice={"type": "tool", "name": "nope"})).message
    )


def test_thinking_toggles_the_template_or_is_refused_without_a_parser() -> None:
    """serving_chat.py `apply_reasoning_enabled`, via the conversion."""
    on = messages_to_chat(body(thinking={"type": "enabled", "budget_tokens": 2048}))
    assert on["chat_template_kwargs"] == {"enable_thinking": True}
    off = messages_to_chat(body(thinking={"type": "disabled"}))
    assert off["chat_template_kwargs"] == {"enable_thinking": False}
    no_parser = EngineTraits(reasoning_toggle=None)
    assert "chat_template_kwargs" not in messages_to_chat(
        body(thinking={"type": "disabled"}), no_parser
    )
    assert "reasoning parser" in refused(body(thinking={"type": "adaptive"}), no_parser).message


def test_output_config() -> None:
    """`_convert_to_chat_completion_request`: format -> response_format, xhigh -> max."""
    chat = messages_to_chat(
        body(
            output_config={"effort": "xhigh", "format": {"type": "json_schema", "schema": {"a": 1}}}
        )
    )
    assert chat["reasoning_effort"] == "max"
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "response", "schema": {"a": 1}, "strict": True},
    }


@pytest.mark.parametrize(
    ("document", "where"),
    [
        ({"max_tokens": 1, "messages": []}, "model"),
        (body(max_tokens=0), "max_tokens"),
        (body(max_tokens="5"), "max_tokens"),
        (body(messages=[{"role": "tool", "content": "x"}]), "messages.0.role"),
        (body(messages=[{"role": "user", "content": [{"type": "video"}]}]), "messages.0.content.0"),
        (body(messages=[{"role": "user", "content": [{"type": "text", "text": 3}]}]), "text.text"),
        (body(messages=[{"role": "user", "content": 7}]), "messages.0.content"),
        (body(stream="yes"), "stream"),
        (body(thinking={"type": "enabled", "budget_tokens": 10}), "thinking"),
        (body(tools=[{"name": "t"}]), "tools.0.custom.input_schema"),
        (body(tool_choice={"type": "sometimes"}), "tool_choice.type"),
    ],
)
def test_invalid_bodies_are_400_naming_the_field(document: dict[str, Any], where: str) -> None:
    """protocol.py's models, answered by http_server.py `_anthropic_validation_message`."""
    assert where in refused(document).message


def test_tool_result_must_answer_the_preceding_tool_use() -> None:
    """The session route's own rule (not SGLang's): check_tool_links."""
    check_tool_links(body(messages=agent_history()))
    orphan = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope"}]}]
    with pytest.raises(DialectError) as caught:
        ANTHROPIC.to_chat(body(messages=orphan))
    assert caught.value.status == 400 and "nope" in caught.value.message


def chat_reply(message: dict[str, Any], finish: str = "stop") -> dict[str, Any]:
    return {
        "id": "x",
        "object": "chat.completion",
        "model": "served",
        "choices": [
            {"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish}
        ],
        "usage": {
            "prompt_tokens": 10,
            "completion_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": 4},
        },
    }


TOOL_REPLY = chat_reply(
    {
        "content": "ok",
        "reasoning_content": "think",
        "tool_calls": [
            {
                "id": "call_9",
                "type": "function",
                "function": {"name": "get", "arguments": '{"a": 1}'},
            }
        ],
    },
    "tool_calls",
)


def test_reply_blocks_stop_reason_and_usage() -> None:
    """`_convert_response` and `_anthropic_usage_from_openai` (cached tokens apart)."""
    message = chat_reply_to_message(TOOL_REPLY, body(), message_id="msg_1")
    assert message == {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "think"},
            {"type": "text", "text": "ok"},
            {"type": "tool_use", "id": "call_9", "name": "get", "input": {"a": 1}},
        ],
        "model": "served",
        "stop_reason": "tool_use",
        "usage": {"input_tokens": 6, "cache_read_input_tokens": 4, "output_tokens": 3},
    }
    # The SDK parses replies leniently (construct_type), as its client does: SGLang's
    # thinking blocks carry no signature, which its strict model would require.
    parsed = construct_type(type_=anthropic.types.Message, value=message)
    assert [b.type for b in parsed.content] == ["thinking", "text", "tool_use"]
    assert chat_reply_to_message(chat_reply({"content": ""}, "length"), body())["content"] == [
        {"type": "text", "text": ""}
    ]
    assert (
        chat_reply_to_message(chat_reply({"content": "x"}, "abort"), body())["stop_reason"]
        == "end_turn"
    )
    bad_args = chat_reply(
        {"tool_calls": [{"id": "c", "function": {"name": "n", "arguments": "[1"}}]}
    )
    assert chat_reply_to_message(bad_args, body())["content"][0]["input"] == {}


def parse_events(stream: bytes) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for chunk in stream.decode().split("\n\n"):
        if chunk:
            head, data = chunk.split("\n")
            events.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


def test_stream_events_in_order() -> None:
    """`_generate_anthropic_stream`: message_start (output 0), a block per part with its
    delta, message_delta (stop reason, output usage only), message_stop."""
    stream = b"".join(message_stream_events(TOOL_REPLY, body(), message_id="msg_2"))
    events = parse_events(stream)
    assert [(kind, data.get("index")) for kind, data in events] == [
        ("message_start", None),
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("content_block_start", 2),
        ("content_block_delta", 2),
        ("content_block_stop", 2),
        ("message_delta", None),
        ("message_stop", None),
    ]
    assert all(kind == data["type"] for kind, data in events)
    assert events[0][1]["message"]["usage"] == {
        "input_tokens": 6,
        "cache_read_input_tokens": 4,
        "output_tokens": 0,
    }
    assert events[0][1]["message"]["model"] == "m"  # the request's model, as SGLang's stream
    assert events[8][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"a": 1}'}
    assert events[10][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "tool_use"},
        "usage": {"output_tokens": 3},
    }


def test_the_sdk_accumulates_the_stream() -> None:
    """The events parse as the real SDK's stream events and accumulate to the message."""
    from anthropic.lib.streaming._messages import accumulate_event

    message = None
    buffers: dict[int, bytes] = {}
    for _, data in parse_events(b"".join(message_stream_events(TOOL_REPLY, body()))):
        parsed = construct_type(type_=anthropic.types.RawMessageStreamEvent, value=data)
        message = accumulate_event(event=parsed, current_snapshot=message, json_bufs=buffers)
    assert message is not None
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[2].input == {"a": 1}
    assert message.stop_reason == "tool_use"


def test_error_envelopes() -> None:
    """http_server.py `_anthropic_error_response`; serving.py `_convert_openai_error_response`
    (4xx keep the engine's message and type, 5xx are scrubbed)."""
    assert error_envelope(404, "gone") == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "gone"},
    }
    engine_400 = json.dumps(
        {"object": "error", "message": "too long", "type": "BadRequestError", "code": 400}
    )
    assert engine_error_to_envelope(400, engine_400.encode()) == {
        "type": "error",
        "error": {"type": "BadRequestError", "message": "too long"},
    }
    assert engine_error_to_envelope(500, b'{"message": "trace"}')["error"] == {
        "type": "api_error",
        "message": "Internal server error",
    }
    assert json.loads(ANTHROPIC.error_body(413, "big"))["error"]["type"] == "request_too_large"
    assert json.loads(CHAT.error_body(400, "x")) == {"error": "x"}

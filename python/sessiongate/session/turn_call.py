"""Phase 2 of a TITO turn (docs/architecture.md), without the session lock: what the engine
is sent (the client's body plus the TITO fields, the routing mode's stamps, the headers), and
the shape of a buffered turn's reply to a client that asked for a stream.

Pure functions of the planned `Turn` and the settings: the call itself, which owns the
engine exchange and the turn's end, is `SessionTurns` (turn.py).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any, TypeVar

from sessiongate.http.forwarding import forwardable_headers
from sessiongate.primitives import rewrite_request
from sessiongate.session.settings import SessionSettings
from sessiongate.session.turn_plan import Turn
from sessiongate.session_routing.stamper import SessionStamper

_T = TypeVar("_T")

# Bodies above this are handled in a thread: the Rust primitives release the GIL, so the
# event loop keeps serving other sessions meanwhile; small ones are cheaper inline.
OFF_LOOP_ABOVE = 256 * 1024


async def off_loop(function: Callable[..., _T], data: bytes, *args: Any) -> _T:
    if len(data) > OFF_LOOP_ABOVE:
        return await asyncio.to_thread(function, data, *args)
    return function(data, *args)


def upstream_fields(turn: Turn, settings: SessionSettings, *, relay: bool) -> dict[str, Any]:
    """The members a session turn sets in the client's body (docs/api.md, "Upstream")."""
    fields: dict[str, Any] = {
        "input_ids": turn.prompt_ids,
        "logprobs": True,
        "no_stop_trim": False,
    }
    if relay:
        # SGLang rejects return_meta_info with stream (400) and streams no meta_info:
        # ask for the extras a stream can carry instead (session/stream.py).
        fields["stream"] = True
        fields["return_meta_info"] = False
        fields["return_output_ids_in_sglext"] = True
        fields["stream_options"] = {"include_usage": True}
        # The usage chunk has cached tokens only with --enable-cache-report; sglext has
        # them when asked (none when nothing was cached).
        fields["return_cached_tokens_details"] = True
    else:
        fields["stream"] = False
        fields["return_meta_info"] = True
        fields["stream_options"] = None  # only valid with stream
    if settings.r3:
        fields["return_routed_experts"] = True
        if settings.r3_addition:
            fields["routed_experts_start_len"] = turn.r3_start_row
    if settings.indexer_replay:
        fields["return_indexer_topk"] = True
    if settings.lora_path is not None:
        fields["lora_path"] = settings.lora_path
    if turn.template_kwargs:
        # The engine's parsers (reasoning, tools) must see what the prompt was built with.
        fields["chat_template_kwargs"] = turn.template_kwargs
    return fields


async def upstream_body(
    raw: bytes,
    body: dict[str, Any],
    fields: dict[str, Any],
    turn: Turn,
    stamper: SessionStamper | None,
) -> bytes:
    """The body sent upstream: the client's `raw` bytes (parsed: `body`) with `fields` set,
    as the session routing mode (if any) rewrites it."""
    if stamper is None or not stamper.mutates_body or turn.routing is None:
        # No body rewrite: the client's bytes plus the TITO fields, never re-serialised.
        return await off_loop(rewrite_request, raw, fields)
    if stamper.has_bytes_path:
        # dynamo_nvext: splice its member into the client's bytes, then add the TITO fields
        # (parse-equal to the other order, and the splice does not have to scan the prompt
        # ids); neither step re-serialises the body.
        spliced = await off_loop(stamper.transform_bytes, raw, turn.routing)
        if spliced is not None:
            return await off_loop(rewrite_request, spliced, fields)
    # Modes with an object rewrite only work on the parsed body, re-serialised. Modes see
    # the ids as the list the body's JSON holds.
    plain = {**fields, "input_ids": turn.prompt_ids.tolist()}
    stamped = stamper.transform({**body, **plain}, turn.routing)
    return json.dumps(stamped, ensure_ascii=False, separators=(",", ":")).encode()


def turn_headers(
    session_id: str,
    client: list[tuple[str, str]],
    routing: list[tuple[str, str]],
    settings: SessionSettings,
) -> list[tuple[str, str]]:
    """The client's headers (less hop-by-hop ones and the body's own), the default routing
    key, then the routing mode's headers; later ones replace same-named ones."""
    stamped: list[tuple[str, str]] = []
    if settings.smg_routing_key:
        stamped.append(("X-SMG-Routing-Key", session_id))
    stamped.extend(routing)
    replaced = {name.lower() for name, _ in stamped} | {"content-type"}
    kept = [(k, v) for k, v in forwardable_headers(client) if k.lower() not in replaced]
    return [*kept, *stamped]


def wants_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


def one_chunk_sse(client_body: bytes) -> bytes:
    """A buffered turn as one `chat.completion.chunk` event, then `[DONE]`, shaped as the
    rollout framework shapes it (miles/rollout/session/core.py `_response_to_stream_chunk`):
    the first choice only, as index 0, its whole message as one delta (tool calls with their
    `index`, as streamed calls have), its finish reason, then the usage when there is one; no
    `logprobs` and no `meta_info` (the record has them)."""
    document = json.loads(client_body)
    choices = document.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    message = choice.get("message") or {}
    delta: dict[str, Any] = {
        "role": message.get("role", "assistant"),
        "content": message.get("content"),
    }
    if message.get("reasoning_content") is not None:
        delta["reasoning_content"] = message["reasoning_content"]
    if message.get("tool_calls"):
        delta["tool_calls"] = [
            {**call, "index": index} if isinstance(call, dict) else call
            for index, call in enumerate(message["tool_calls"])
        ]
    # The framework's key order, with id / created / model null when the reply lacks them.
    chunk: dict[str, Any] = {
        "id": document.get("id"),
        "object": "chat.completion.chunk",
        "created": document.get("created"),
        "model": document.get("model"),
        "choices": [{"index": 0, "delta": delta, "finish_reason": choice.get("finish_reason")}],
    }
    if document.get("usage") is not None:
        chunk["usage"] = document["usage"]
    try:
        event = json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:
        # A lone surrogate the engine escaped: \u escapes are still valid JSON.
        event = json.dumps(chunk, separators=(",", ":")).encode()
    return b"data: " + event + b"\n\ndata: [DONE]\n\n"

"""Starlette app of the mock engine: SGLang 0.5.23's OpenAI chat contract plus introspection.

What each reply looks like follows SGLang's own code (see docs/mock-engine.md for the source
of every shape): `entrypoints/openai/serving_chat.py` (request checks, `_build_chat_response`,
`_generate_chat_stream`), `sse_utils.py` (`build_sse_content`), `protocol.py` (pydantic
models and their serializers), `usage_processor.py` and `managers/tokenizer_manager.py`
(meta_info).

Heavy work (prompt validation/tokenization, generation, R3 bytes, JSON assembly) runs in a
worker thread so `/health` keeps answering while a 100 MiB reply is being built.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import random
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Literal, TypeAlias

import anyio.to_thread
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from sessiongate.mock_engine.completion import Completion, StreamPiece
from sessiongate.mock_engine.config import MockEngineConfig
from sessiongate.mock_engine.generate import CompletionGenerator
from sessiongate.mock_engine.prefix_cache import PrefixCache
from sessiongate.mock_engine.routed_experts import (
    R3_POOL_CHUNK_B64,
    r3_pool_rows,
    routed_experts_b64_parts,
)
from sessiongate.mock_engine.tokens import TokenizerLike
from sessiongate.tokenizer.tool_arguments import ToolArgumentsError, template_messages

# A body slice: bytes, or a read-only view into the shared R3 pool.
Part: TypeAlias = bytes | memoryview

RECENT_REQUESTS = 256
# Large bodies go out in slices this big: each send blocks the event loop only briefly and
# uvicorn's flow control paces them (one 80 MiB write would be copied into asyncio's buffer).
# The R3 pool's chunks are at most this big, so they go out as they are (see `_send_slices`).
SEND_SLICE = R3_POOL_CHUNK_B64
# Stand in for the big base64 strings while the small rest of the reply goes through
# json.dumps; the bytes are spliced in afterwards (json.dumps of an 80 MiB string is waste).
_R3_PLACEHOLDER = "@@sessiongate-mock-routed-experts@@"
_INDEXER_PLACEHOLDER = "@@sessiongate-mock-indexer-topk@@"
# Indexer top-k values are KV positions; the mock draws them in [0, this).
INDEXER_POSITIONS = 4096
# SGLang's ChatCompletionRequest.model default (protocol.py DEFAULT_MODEL_NAME).
DEFAULT_MODEL = "default"
# serving_chat.py `_convert_to_internal_request`, checked in this order with `stream`.
_STREAM_ERRORS = (
    (
        "return_prompt_token_ids",
        "return_prompt_token_ids is not supported with streaming. "
        "Please set stream=false when using return_prompt_token_ids=true.",
    ),
    (
        "return_token_ids",
        "return_token_ids is not supported with streaming on /v1/chat/completions. "
        "Please set stream=false when using return_token_ids=true.",
    ),
    (
        "return_meta_info",
        "return_meta_info is not supported with streaming. "
        "Please set stream=false when using return_meta_info=true.",
    ),
)


class ApiError(Exception):
    """A chat request SGLang would refuse; answered with its `ErrorResponse` body."""

    def __init__(self, message: str, err_type: str = "BadRequestError", status: int = 400):
        super().__init__(message)
        self.message = message
        self.err_type = err_type
        self.status = status

    def response(self) -> Response:
        return error_response(self.message, self.err_type, self.status)


def error_response(message: str, err_type: str, status: int) -> Response:
    """SGLang's `OpenAIServingBase.create_error_response` body (serving_base.py)."""
    body = {"object": "error", "message": message, "type": err_type, "param": None}
    return _json({**body, "code": status}, status)


def _validation_error(errors: list[dict[str, Any]]) -> ApiError:
    """What SGLang's RequestValidationError handler (http_server.py) answers for a body that
    fails pydantic validation: 400, type "Bad Request", the errors in the message. (FastAPI
    also echoes each error's input; the mock leaves it out.)"""
    return ApiError(str(errors), HTTPStatus.BAD_REQUEST.phrase, 400)


def _injected(status: int) -> Response:
    kind = "InternalServerError" if status >= 500 else "BadRequestError"
    return error_response("injected failure", kind, status)


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """What the engine needs from a validated chat body (defaults: a plain request, so
    in-process callers such as the relay tests can build one by hand)."""

    prompt_ids: list[int]
    seed: int | None
    max_tokens: int | None
    tools: list[Any] | None  # None when the tool-call parser is not active for the request
    stream: bool
    want_meta: bool  # return_meta_info
    want_logprobs: bool
    want_r3: bool  # return_routed_experts and the engine has R3 on
    model: str = DEFAULT_MODEL
    rid: str = ""  # "" = set by the caller (build_reply's request_id)
    r3_start: int = 0
    want_indexer: bool = False
    want_input_ids: bool = False
    want_output_ids: bool = False
    ids_framed: bool = False
    include_usage: bool = False
    reasoning: bool = False
    lora: str | None = None
    # A stream the scheduler aborted at once (a bad routed_experts_start_len): its message.
    abort_message: str | None = None
    want_cached_details: bool = False  # return_cached_tokens_details


@dataclass(slots=True)
class EngineState:
    config: MockEngineConfig
    tokenizer: TokenizerLike
    generator: CompletionGenerator
    prefix_cache: PrefixCache = field(default_factory=lambda: PrefixCache(0))
    weight_version: str = "default"
    recent: deque[bytes] = field(default_factory=lambda: deque(maxlen=RECENT_REQUESTS))
    # The headers of the same requests (a capture for session-routing tests).
    recent_headers: deque[dict[str, str]] = field(
        default_factory=lambda: deque(maxlen=RECENT_REQUESTS)
    )
    # Set on shutdown: pending delays end at once so uvicorn's graceful shutdown is quick.
    closing: asyncio.Event = field(default_factory=asyncio.Event)
    # rid -> event set by /abort_request (running requests only, as in SGLang).
    running: dict[str, asyncio.Event] = field(default_factory=dict)
    # Token counts after which the next chat requests are aborted (POST /mock/abort_next).
    abort_next: deque[int] = field(default_factory=deque)
    requests: int = 0
    failures: int = 0
    bad_requests: int = 0
    streams: int = 0
    in_flight: int = 0
    prompt_tokens: int = 0
    tokens_generated: int = 0
    aborted: int = 0

    def stats(self) -> dict[str, int]:
        return {
            "requests": self.requests,
            "failures": self.failures,
            "bad_requests": self.bad_requests,
            "streams": self.streams,
            "in_flight": self.in_flight,
            "prompt_tokens": self.prompt_tokens,
            "tokens_generated": self.tokens_generated,
            "aborted": self.aborted,
        }


def _json(payload: Any, status: int = 200) -> Response:
    body = json.dumps(payload, separators=(",", ":")).encode()
    return Response(body, status_code=status, media_type="application/json")


# ---------------------------------------------------------------- request validation

_INT_FIELDS = ("seed", "max_tokens", "max_completion_tokens", "routed_experts_start_len")
_BOOL_FIELDS = (
    "stream",
    "logprobs",
    "return_meta_info",
    "return_routed_experts",
    "return_indexer_topk",
    "return_input_ids_in_sglext",
    "return_output_ids_in_sglext",
    "separate_reasoning",
    "return_sampling_mask",
    "return_flat_raw_output_top_logprobs",
)
# serving_chat.py `_validate_request`: flags that only make sense with meta_info, refused
# (400 "BadRequestError") when it is off.
_NEEDS_META_INFO = ("return_sampling_mask", "return_flat_raw_output_top_logprobs")


def _schema_errors(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The pydantic errors SGLang's ChatCompletionRequest would raise, for the fields the
    mock reads (unknown fields are ignored, as pydantic's default `extra="ignore"` does)."""
    errors: list[dict[str, Any]] = []

    def bad(name: str, kind: str, msg: str) -> None:
        errors.append({"type": kind, "loc": ("body", name), "msg": msg})

    if "messages" not in body:
        bad("messages", "missing", "Field required")
    elif not isinstance(body["messages"], list):
        bad("messages", "list_type", "Input should be a valid list")
    elif not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in body["messages"]):
        bad("messages", "union_tag_invalid", "Every message must be an object with a role")
    for name in _INT_FIELDS:
        value = body.get(name)
        if value is not None and type(value) is not int:
            bad(name, "int_type", "Input should be a valid integer")
    for name in _BOOL_FIELDS:
        value = body.get(name)
        if value is not None and type(value) is not bool:
            bad(name, "bool_type", "Input should be a valid boolean")
    ids = body.get("input_ids")
    if ids is not None and (not isinstance(ids, list) or not all(type(i) is int for i in ids)):
        bad("input_ids", "int_type", "Input should be a list of valid integers")
    for name, kind in (("tools", list), ("chat_template_kwargs", dict), ("stream_options", dict)):
        value = body.get(name)
        if value is not None and not isinstance(value, kind):
            bad(name, f"{kind.__name__}_type", f"Input should be a valid {kind.__name__}")
    for name in ("rid", "model", "lora_path"):
        value = body.get(name)
        if value is not None and not isinstance(value, str):
            bad(name, "string_type", "Input should be a valid string")
    return errors


def _prompt_ids(body: dict[str, Any], tokenizer: TokenizerLike) -> list[int]:
    ids = body.get("input_ids")
    if ids is not None:
        # SGLang bypasses the chat template when input_ids are given (protocol.py).
        if not ids:
            raise ApiError("input_ids must be a non-empty list of token ids")
        low, high = min(ids), max(ids)
        if low < 0 or high >= tokenizer.vocab_size:
            raise ApiError(f"input_ids out of range [0, {tokenizer.vocab_size})")
        return list(ids)
    # serving_chat.py `_apply_jinja_template` parses assistant tool-call arguments before it
    # renders (`normalize_assistant_tool_call_arguments`, strict); its ValueError is a 400
    # "BadRequest" in serving_base.py `handle_request`.
    try:
        messages = template_messages(body["messages"])
    except ToolArgumentsError as exc:
        raise ApiError(exc.reason, "BadRequest") from exc
    kwargs = body.get("chat_template_kwargs") or {}
    try:
        ids = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            messages,
            add_generation_prompt=True,
            tools=body.get("tools"),
            chat_template_kwargs=kwargs or None,
        )
    except Exception as exc:  # a template error is the caller's malformed message
        raise ApiError(f"cannot render messages with the chat template: {exc}") from exc
    return list(ids)


def _lora(body: dict[str, Any], served_model: str, loaded: tuple[str, ...]) -> str | None:
    """The adapter a request names ('base:adapter' model wins over lora_path, as in
    serving_base.py `_resolve_lora_path`), checked like tokenizer_manager.py does."""
    model = body.get("model") or DEFAULT_MODEL
    adapter: str | None = None
    if ":" in model and model != served_model:
        if model.startswith(served_model + ":"):
            adapter = model[len(served_model) + 1 :].strip() or None
        else:
            adapter = model.split(":", 1)[1].strip() or None
    if adapter is None:
        adapter = body.get("lora_path") or None
    if adapter is None:
        return None
    if not loaded:
        raise ApiError(
            f"LoRA adapter '{adapter}' was requested, but LoRA is not enabled. "
            "Please launch the server with --enable-lora flag and preload adapters "
            "using --lora-paths or /load_lora_adapter endpoint."
        )
    if adapter not in loaded:
        names = "dict_keys([" + ", ".join(repr(n) for n in loaded) + "])"
        raise ApiError(
            f"Got LoRA adapter that has never been loaded: {adapter}\nAll loaded adapters: {names}."
        )
    return adapter


def parse_chat(body: dict[str, Any], headers: Mapping[str, str], state: EngineState) -> ChatRequest:
    """Validate a chat body in SGLang's order and resolve its prompt (worker thread)."""
    cfg = state.config
    errors = _schema_errors(body)
    if errors:
        raise _validation_error(errors)
    # serving_chat.py `_validate_request`.
    if not body["messages"]:
        raise ApiError("Messages cannot be empty.")
    for flag in _NEEDS_META_INFO:
        if body.get(flag) is True and body.get("return_meta_info") is not True:
            raise ApiError(f"{flag} requires return_meta_info=true.")
    stream = body.get("stream") is True
    # serving_chat.py `_convert_to_internal_request` raises ValueError, which
    # `handle_request` answers with err_type "BadRequest".
    for name, message in _STREAM_ERRORS if stream else ():
        if body.get(name) is True:
            raise ApiError(message, "BadRequest")
    caps = [body[c] for c in ("max_tokens", "max_completion_tokens") if body.get(c) is not None]
    if any(c < 1 for c in caps):
        raise ApiError("max_tokens must be >= 1")
    prompt_ids = _prompt_ids(body, state.tokenizer)
    lora = _lora(body, cfg.model_name, cfg.lora_adapters)
    want_r3 = body.get("return_routed_experts") is True
    r3_start = body.get("routed_experts_start_len") or 0
    r3_error: str | None = None
    if want_r3:  # scheduler.py `handle_generate_request`: FINISH_ABORT, status 400
        if r3_start < 0:
            r3_error = (
                f"recv_req.routed_experts_start_len={r3_start} is lower than 0. "
                "Please use a non-negative routed_experts_start_len."
            )
        if r3_start > len(prompt_ids):
            r3_error = (
                f"recv_req.routed_experts_start_len={r3_start} is higher than the number of "
                f"input tokens len(req.origin_input_ids)={len(prompt_ids)}. Please use a "
                "smaller routed_experts_start_len."
            )
    if r3_error is not None and not stream:
        # tokenizer_manager.py `_handle_abort_finish_reason`: status 400 -> ValueError -> 400.
        raise ApiError(r3_error)
    tools = body.get("tools") or None
    if body.get("tool_choice") == "none":
        tools = None  # SGLang's tool-call parser is off for tool_choice "none"
    kwargs = body.get("chat_template_kwargs") or {}
    stream_options = body.get("stream_options") or {}
    model = body.get("model")
    return ChatRequest(
        rid=body["rid"] if body.get("rid") else uuid.uuid4().hex,
        prompt_ids=prompt_ids,
        seed=body.get("seed"),
        max_tokens=min(caps) if caps else None,
        tools=tools,
        stream=stream,
        want_meta=body.get("return_meta_info") is True,
        want_logprobs=body.get("logprobs") is True,
        want_r3=want_r3 and cfg.r3_enabled,
        r3_start=r3_start,
        want_indexer=body.get("return_indexer_topk") is True and cfg.indexer_enabled,
        want_input_ids=body.get("return_input_ids_in_sglext") is True
        or headers.get("x-sglext-return-input-ids") == "1",
        want_output_ids=body.get("return_output_ids_in_sglext") is True
        or headers.get("x-sglext-return-output-ids") == "1",
        ids_framed=headers.get("x-sglext-ids-framed") == "1",
        include_usage=stream_options.get("include_usage") is True,
        reasoning=cfg.reasoning_parser is not None and kwargs.get("enable_thinking") is not False,
        lora=lora,
        abort_message=r3_error,
        want_cached_details=body.get("return_cached_tokens_details") is True,
        model=model if isinstance(model, str) and model else DEFAULT_MODEL,
    )


# ---------------------------------------------------------------- reply pieces


def _r3_parts(req: ChatRequest, completion: Completion, cfg: MockEngineConfig) -> list[Part]:
    # Rows [start, prompt + completion - 1) (io_struct.py GenerateReqInput docs); row r is
    # the routing of token r, a function of the tokens up to it (see routed_experts_b64_parts).
    return routed_experts_b64_parts(
        [*req.prompt_ids, *completion.ids],
        cfg.r3_layers,
        cfg.r3_topk,
        cfg.r3_experts,
        req.r3_start,
        seed=cfg.seed,
    )


def _indexer_parts(req: ChatRequest, completion: Completion, cfg: MockEngineConfig) -> list[Part]:
    return routed_experts_b64_parts(
        [*req.prompt_ids, *completion.ids],
        cfg.indexer_layers,
        cfg.indexer_topk,
        INDEXER_POSITIONS,
        seed=cfg.seed,
        tag=b"indexer",
    )


def meta_info(
    req: ChatRequest,
    completion: Completion,
    *,
    cached_tokens: int,
    weight_version: str,
    e2e_latency: float,
    with_r3: bool,
    cfg: MockEngineConfig,
) -> tuple[dict[str, Any], dict[str, list[Part]]]:
    """SGLang's meta_info (tokenizer_manager.py `_handle_batch_output`, keys in its order),
    and the big base64 values to splice in for their placeholders."""
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": completion.meta_finish_reason,
        "prompt_tokens": completion.prompt_tokens,
        "weight_version": weight_version,
        "num_retractions": 0,
    }
    if req.want_logprobs:  # add_logprob_to_meta_info: only when logprobs were asked for
        meta["input_token_logprobs"] = []  # logprob_start_len -1 = output logprobs only
        meta["output_token_logprobs"] = completion.output_token_logprobs()
        meta["output_token_logprobs_length"] = completion.completion_tokens
    meta["reasoning_tokens"] = completion.reasoning_tokens
    meta["completion_tokens"] = completion.completion_tokens
    meta["cached_tokens"] = cached_tokens
    # utils/weight_versions.py `add_weight_versions_to_meta_info`: the spans of output tokens
    # per weight version; the mock samples a whole reply under one version.
    meta["weight_versions"] = weight_version_spans(weight_version, completion.completion_tokens)
    # scheduler_components/output_streamer.py `get_cached_tokens_details`: null without a
    # cache hit, else the split by cache tier (no hierarchical cache: all on the device).
    meta["cached_tokens_details"] = (
        {"device": cached_tokens, "host": 0} if cached_tokens > 0 else None
    )
    splices: dict[str, list[Part]] = {}
    if with_r3:
        meta["routed_experts"] = _R3_PLACEHOLDER
        splices[_R3_PLACEHOLDER] = _r3_parts(req, completion, cfg)
    if req.want_indexer:
        meta["indexer_topk"] = _INDEXER_PLACEHOLDER
        meta["indexer_topk_num_layers"] = cfg.indexer_layers
        splices[_INDEXER_PLACEHOLDER] = _indexer_parts(req, completion, cfg)
    meta["e2e_latency"] = e2e_latency
    # tokenizer_manager.py stamps the wall-clock time just before handing the finished output
    # to the endpoint.
    meta["response_sent_to_client_ts"] = time.time()
    return meta, splices


def weight_version_spans(version: str, completion_tokens: int) -> list[dict[str, Any]]:
    """`meta_info.weight_versions` of a reply sampled under one weight version."""
    return [{"version": version, "start": 0, "end": completion_tokens}]


def dumps_spliced(payload: Any, splices: Mapping[str, list[Part]]) -> list[Part]:
    """Compact JSON of `payload` as byte slices, each placeholder string replaced by its
    slices (base64, so no escaping is needed). First and last slices are `bytes`."""
    body = json.dumps(payload, separators=(",", ":")).encode()
    if not splices:
        return [body]
    slots = {json.dumps(k).encode(): v for k, v in splices.items()}
    parts: list[Part] = []
    rest = body
    while True:
        found = [(rest.find(slot), slot) for slot in slots if slot in rest]
        if not found:
            break
        at, slot = min(found)
        parts.append(rest[:at] + b'"')
        parts.extend(slots[slot])
        rest = b'"' + rest[at + len(slot) :]
    parts.append(rest)
    return parts


def _send_slices(parts: list[Part]) -> Iterator[Part]:
    """`parts` cut to at most SEND_SLICE bytes each, without copying.

    A `bytes` part that is small enough goes out as that very object: h11 passes a lone bytes
    object through (`b"".join([b])` is `b`) but copies a memoryview, so the R3 pool's chunks
    reach the socket uncopied.
    """
    for part in parts:
        if len(part) <= SEND_SLICE:
            yield part
            continue
        view = memoryview(part)
        for start in range(0, len(view), SEND_SLICE):
            yield view[start : start + SEND_SLICE]


class PartsResponse(Response):
    """A response whose body is a list of byte slices, sent without joining them."""

    def __init__(self, parts: list[Part], status_code: int = 200) -> None:
        super().__init__(b"", status_code=status_code, media_type="application/json")
        self.parts = parts
        length = str(sum(len(p) for p in parts)).encode()
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self.raw_headers.append((b"content-length", length))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        for chunk in _send_slices(self.parts):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _openai_logprobs(completion: Completion, start: int, stop: int) -> dict[str, Any]:
    """ChoiceLogprobs (serving_chat.py `_build_token_logprobs_from_raw`): token text and
    bytes, no token ids; field order token, bytes, logprob, top_logprobs."""
    content = []
    for i in range(start, stop):
        text = completion.token_texts[i]
        content.append(
            {
                "token": text,
                # From the token id (byte-level BPE): a piece of a character has text
                # "\ufffd" but its own bytes.
                "bytes": list(completion.token_bytes[i])
                if completion.token_bytes
                else list(text.encode()),
                "logprob": completion.logprobs[i],
                "top_logprobs": [],
            }
        )
    return {"content": content}


def _usage(completion: Completion, cached: int, cfg: MockEngineConfig) -> dict[str, Any]:
    """UsageInfo (usage_processor.py `calculate_token_usage`, protocol.py field order)."""
    reasoning = completion.reasoning_tokens
    return {
        "prompt_tokens": completion.prompt_tokens,
        "total_tokens": completion.prompt_tokens + completion.completion_tokens,
        "completion_tokens": completion.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached} if cfg.enable_cache_report else None,
        "reasoning_tokens": reasoning,
        "completion_tokens_details": {"reasoning_tokens": reasoning} if reasoning else None,
    }


def _cached_details(req: ChatRequest, cached: int) -> dict[str, int] | None:
    """sglext.cached_tokens_details when asked (serving_chat.py): the scheduler reports none
    for a request with nothing cached, else the device / host split (output_streamer.py
    `get_cached_tokens_details`; the mock's cache is all device memory)."""
    if not req.want_cached_details or cached <= 0:
        return None
    return {"device": cached, "host": 0}


def _choice_finish(completion: Completion, *, stream: bool) -> tuple[str, Any, dict[str, Any]]:
    """(choice finish_reason, matched_stop, meta_info finish_reason).

    Non-stream, SGLang's tool-call parser rewrites the engine's stop dict in place to
    `{"type": "tool_calls", "matched": None}` (serving_chat.py `_process_tool_calls`), so
    meta_info shows it too. The stream keeps the engine's dict: its finish chunk says
    "tool_calls" but matched_stop is still the stop token.
    """
    meta = dict(completion.meta_finish_reason)
    if completion.finish_reason == "tool_calls":
        if stream:
            return "tool_calls", meta.get("matched"), meta
        meta = {"type": "tool_calls", "matched": None}
    return meta["type"], meta.get("matched"), meta


@dataclass(frozen=True, slots=True)
class Outcome:
    """A finished generation as the reply builders see it."""

    completion: Completion
    cached_tokens: int
    weight_version: str
    e2e_latency: float


def build_reply(
    req: ChatRequest,
    out: Outcome | Completion,
    state: EngineState,
    request_id: str | None = None,
) -> list[Part]:
    """The whole non-stream reply body (serving_chat.py `_build_chat_response`).

    A bare `Completion` stands for an uncached reply at the engine's weight version (the
    in-process callers); `request_id` fills in a request without a rid.
    """
    cfg = state.config
    if isinstance(out, Completion):
        out = Outcome(out, 0, state.weight_version, 0.0)
    if request_id is not None and not req.rid:
        req = dataclasses.replace(req, rid=request_id)
    completion = out.completion
    finish, matched, meta_finish = _choice_finish(completion, stream=False)
    reasoning = completion.reasoning
    message: dict[str, Any] = {
        "role": "assistant",
        "content": completion.content,
        "reasoning_content": reasoning if reasoning else None,
    }
    if completion.tool_call is not None:
        message["tool_calls"] = [completion.tool_call.to_openai()]
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": finish,
        "matched_stop": matched,
    }
    if req.want_logprobs:
        choice["logprobs"] = _openai_logprobs(completion, 0, completion.completion_tokens)
    splices: dict[str, list[Part]] = {}
    if req.want_meta:
        # With return_meta_info the engine's routed_experts stay in meta_info only.
        meta, splices = meta_info(
            req,
            completion,
            cached_tokens=out.cached_tokens,
            weight_version=out.weight_version,
            e2e_latency=out.e2e_latency,
            with_r3=req.want_r3,
            cfg=cfg,
        )
        meta["finish_reason"] = meta_finish
        choice["meta_info"] = meta
    sglext: dict[str, Any] = {}
    if req.want_r3 and not req.want_meta:
        sglext["routed_experts"] = _R3_PLACEHOLDER
        splices[_R3_PLACEHOLDER] = _r3_parts(req, completion, cfg)
    details = _cached_details(req, out.cached_tokens)
    if details is not None:
        sglext["cached_tokens_details"] = details
    if req.want_input_ids:
        sglext["input_ids"] = req.prompt_ids
    if req.want_output_ids:
        sglext["output_ids"] = [completion.ids]
    payload: dict[str, Any] = {
        "id": req.rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": [choice],
        "usage": _usage(completion, out.cached_tokens, cfg),
        # utils/weight_versions.py `build_endpoint_weight_version_metadata`, from the
        # engine's meta_info whether or not the client asked to see it.
        "metadata": {
            "weight_version": out.weight_version,
            "weight_versions": weight_version_spans(
                out.weight_version, completion.completion_tokens
            ),
        },
    }
    if sglext:
        payload["sglext"] = sglext
    return dumps_spliced(payload, splices)


class _Chunks:
    """The SSE events of one stream, shaped like SGLang's two chunk builders."""

    def __init__(self, req: ChatRequest, created: int) -> None:
        self.head = {
            "id": req.rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": req.model,
        }

    @staticmethod
    def _event(payload: Any, splices: Mapping[str, list[Part]] | None = None) -> list[Part]:
        parts = dumps_spliced(payload, splices or {})
        parts[0] = b"data: " + parts[0]
        parts[-1] = bytes(parts[-1]) + b"\n\n"  # bytes already (the JSON tail): no copy of R3
        return parts

    def content(
        self,
        *,
        role: str | None = None,
        content: str | None = None,
        reasoning: str | None = None,
        finish: str | None = None,
        logprobs: dict[str, Any] | None = None,
        matched_stop: Any = None,
    ) -> bytes:
        """sse_utils.py `build_sse_content`: msgspec with omit_defaults, so the delta always
        has `reasoning_content` (null or text) and `role` / `content` only when set; the
        choice always has logprobs, finish_reason and matched_stop; no usage key."""
        delta: dict[str, Any] = {"reasoning_content": reasoning}
        if role is not None:
            delta["role"] = role
        if content is not None:
            delta["content"] = content
        choice = {
            "index": 0,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish,
            "matched_stop": matched_stop,
        }
        return bytes(self._event({**self.head, "choices": [choice]})[0])

    def model_chunk(
        self, *, content: str | None = None, tool_calls: list[Any] | None = None
    ) -> bytes:
        """protocol.py ChatCompletionStreamResponse.model_dump_json(), as the tool-call path
        of serving_chat.py `_process_tool_call_stream` sends it: every DeltaMessage field
        but hidden_states (tool_calls only when set), `usage: null`."""
        delta: dict[str, Any] = {"role": None, "content": content, "reasoning_content": None}
        if tool_calls is not None:
            delta["tool_calls"] = tool_calls
        choice = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": None,
            "matched_stop": None,
        }
        return bytes(self._event({**self.head, "choices": [choice], "usage": None})[0])

    def response_level(
        self,
        *,
        usage: dict[str, Any] | None = None,
        sglext: dict[str, Any] | None = None,
        splices: Mapping[str, list[Part]] | None = None,
        event: str | None = None,
    ) -> list[Part]:
        """A `choices: []` chunk (pydantic dump: usage null unless set, sglext only when
        set, its None fields dropped by SglExt's serializer)."""
        payload: dict[str, Any] = {**self.head, "choices": [], "usage": usage}
        if sglext is not None:
            payload["sglext"] = sglext
        parts = self._event(payload, splices)
        if event is not None:
            parts[0] = f"event: {event}\n".encode() + bytes(parts[0])
        return parts


def _piece_events(
    chunks: _Chunks, req: ChatRequest, completion: Completion, piece: StreamPiece, flush: bool
) -> list[bytes]:
    """The chunks of one engine step (serving_chat.py `_generate_stream_content`). `flush`:
    the engine runs a reasoning or tool-call parser."""
    events: list[bytes] = []
    logprobs = _openai_logprobs(completion, piece.start, piece.stop) if req.want_logprobs else None
    if piece.reasoning:  # reasoning first, carrying the step's logprobs
        events.append(chunks.content(reasoning=piece.reasoning, logprobs=logprobs))
        logprobs = None
    if req.tools is not None:  # tool-call parser path: pydantic chunks, no logprobs
        if piece.content:
            events.append(chunks.model_chunk(content=piece.content))
        if piece.tool_call is not None:
            events.append(chunks.model_chunk(tool_calls=[piece.tool_call.to_openai()]))
    elif piece.content:
        events.append(chunks.content(content=piece.content, logprobs=logprobs))
        logprobs = None
    if logprobs is not None and flush:
        # Only an engine with a parser sends a step's unattached logprobs in a chunk of
        # their own; on the plain path a step without text loses them.
        events.append(chunks.content(logprobs=logprobs))
    return events


async def _stream_events(
    req: ChatRequest,
    completion: Completion,
    cached: int,
    state: EngineState,
    abort: asyncio.Event,
) -> AsyncIterator[Part]:
    """serving_chat.py `_generate_chat_stream`: the role chunk with the engine's first
    output, then per step its chunks, the finish chunk, the sglext chunk, the usage chunk
    (only with stream_options.include_usage), [DONE]."""
    cfg = state.config
    chunks = _Chunks(req, int(time.time()))
    # The tool-call path stands for an engine with a tool-call parser.
    flush = cfg.reasoning_parser is not None or cfg.tool_call_parser is not None
    flush = flush or req.tools is not None
    state.in_flight += 1
    try:
        final = completion
        if req.abort_message is not None:
            # The scheduler aborted it before any token (FINISH_ABORT, status 400). The
            # status crosses the process boundary as a plain int, so the stream's
            # `isinstance(status_code, HTTPStatus)` test fails: no error chunk, a finish
            # "abort" like a graceful abort; the prompt was replaced by one token.
            final = dataclasses.replace(state.generator.aborted(completion, 0), prompt_tokens=1)
            yield chunks.content(role="assistant", content="")
        else:
            if await _wait(state, cfg.ttft_ms / 1000, abort) == "closing":
                return  # shutting down: end the stream early, like an engine going away
            pieces = await anyio.to_thread.run_sync(
                state.generator.stream_pieces, completion, cfg.stream_chunk_tokens
            )
            for n, piece in enumerate(pieces):
                if n:
                    delay = cfg.token_delay_ms * (piece.stop - piece.start) / 1000
                    status = await _wait(state, delay, abort)
                    if status == "closing":
                        return
                    if status == "abort":
                        final = state.generator.aborted(completion, piece.start)
                        state.aborted += 1
                        break
                else:
                    # The first output of the engine brings the role chunk.
                    yield chunks.content(role="assistant", content="")
                for event in _piece_events(chunks, req, completion, piece, flush):
                    yield event

        finish, matched, _ = _choice_finish(final, stream=True)
        yield chunks.content(finish=finish, matched_stop=matched)

        def tail() -> list[Part]:
            parts: list[Part] = []
            splices: dict[str, list[Part]] = {}
            non_ids: dict[str, Any] = {}
            if req.want_r3 and req.abort_message is None:
                non_ids["routed_experts"] = _R3_PLACEHOLDER
                splices[_R3_PLACEHOLDER] = _r3_parts(req, final, cfg)
            details = _cached_details(req, cached)
            if details is not None:
                non_ids["cached_tokens_details"] = details
            ids: dict[str, Any] = {}
            if req.want_input_ids:
                ids["input_ids"] = req.prompt_ids
            if req.want_output_ids:
                ids["output_ids"] = [final.ids]
            if req.ids_framed:
                # A named event carries the ids so hops can pick them out without JSON.
                if non_ids:
                    parts += chunks.response_level(sglext=non_ids, splices=splices)
                if ids:
                    parts += chunks.response_level(sglext=ids, event="sglext_ids")
            elif non_ids or ids:
                parts += chunks.response_level(sglext={**non_ids, **ids}, splices=splices)
            if req.include_usage:
                parts += chunks.response_level(usage=_usage(final, cached, cfg))
            return parts

        for part in _send_slices(await anyio.to_thread.run_sync(tail)):
            yield part
        yield b"data: [DONE]\n\n"
        state.tokens_generated += final.completion_tokens
    finally:
        state.in_flight -= 1
        state.running.pop(req.rid, None)


async def _wait(
    state: EngineState, seconds: float, abort: asyncio.Event | None = None
) -> Literal["ok", "closing", "abort"]:
    """Sleep `seconds`, cut short by shutdown ("closing") or an abort of this request."""
    if state.closing.is_set():
        return "closing"
    if abort is not None and abort.is_set():
        return "abort"
    if seconds <= 0:
        return "ok"
    waiters = [asyncio.ensure_future(state.closing.wait())]
    if abort is not None:
        waiters.append(asyncio.ensure_future(abort.wait()))
    try:
        await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
    if state.closing.is_set():
        return "closing"
    if abort is not None and abort.is_set():
        return "abort"
    return "ok"


def _fail_roll(seed: int, counter: int) -> float:
    digest = hashlib.blake2b(f"{seed}|fail|{counter}".encode(), digest_size=16).digest()
    return random.Random(digest).random()


async def _json_body(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None


def create_app(config: MockEngineConfig, tokenizer: TokenizerLike | None = None) -> Starlette:
    """The mock engine as an ASGI app. `tokenizer` overrides `config.tokenizer` (tests)."""
    if tokenizer is None:
        from sessiongate.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(config.tokenizer)
    generator = CompletionGenerator(
        tokenizer,
        engine_seed=config.seed,
        completion_tokens=config.completion_tokens,
        completion_tokens_jitter=config.completion_tokens_jitter,
        tool_call_rate=config.tool_call_rate,
        non_ascii=config.non_ascii,
    )
    state = EngineState(
        config,
        tokenizer,
        generator,
        PrefixCache(config.prefix_cache_tokens),
        config.weight_version,
    )
    if config.r3_enabled:
        # Build the R3 pool now (~10 ms) rather than inside the first R3 reply.
        r3_pool_rows(config.r3_layers, config.r3_topk, config.r3_experts)

    async def chat(request: Request) -> Response:
        state.requests += 1
        counter = state.requests
        received = time.monotonic()
        raw = await request.body()
        # http_server.py `validate_json_request`, then FastAPI's body parsing: both end in
        # SGLang's RequestValidationError handler (400, type "Bad Request").
        media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            # FastAPI answers any body it cannot parse with a 400, too deeply nested JSON
            # (a RecursionError) included, never a 500.
            body = exc
        if isinstance(body, dict):
            state.recent.append(raw)
            state.recent_headers.append(dict(request.headers.items()))
        if media != "application/json":
            state.bad_requests += 1
            msg = "Unsupported Media Type: Only 'application/json' is allowed"
            return _validation_error(
                [{"loc": ("header", "content-type"), "msg": msg, "type": "value_error"}]
            ).response()
        if not isinstance(body, dict):
            state.bad_requests += 1
            kind = "json_invalid" if isinstance(body, Exception) else "model_attributes_type"
            return _validation_error(
                [{"type": kind, "loc": ("body",), "msg": f"Invalid request body: {kind}"}]
            ).response()

        forced = request.headers.get("x-mock-fail")
        if forced is not None:
            if not forced.strip().isdigit() or not 400 <= int(forced) <= 599:
                state.bad_requests += 1
                return error_response(
                    "X-Mock-Fail must be an HTTP error status (400..599)", "BadRequestError", 400
                )
            state.failures += 1
            return _injected(int(forced))
        if config.fail_rate > 0 and _fail_roll(config.seed, counter) < config.fail_rate:
            state.failures += 1
            return _injected(config.fail_status)

        headers = {k.lower(): v for k, v in request.headers.items()}
        try:
            req, completion, cached = await anyio.to_thread.run_sync(_prepare, body, headers)
        except ApiError as exc:
            state.bad_requests += 1
            return exc.response()
        state.prompt_tokens += completion.prompt_tokens
        abort = asyncio.Event()
        state.running[req.rid] = abort

        if req.stream:
            state.streams += 1
            events = _stream_events(req, completion, cached, state, abort)
            # serving_chat.py `_handle_streaming_request` waits for the first chunk (the
            # role chunk, with the first token) before the 200 goes out.
            try:
                first = await events.__anext__()
            except StopAsyncIteration:
                return error_response("mock engine is shutting down", "InternalServerError", 503)

            async def body() -> AsyncIterator[Part]:
                yield first
                async for event in events:
                    yield event

            return StreamingResponse(
                body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        state.in_flight += 1
        try:
            start = time.monotonic()
            delay_ms = config.ttft_ms + config.token_delay_ms * completion.completion_tokens
            status = await _wait(state, delay_ms / 1000, abort)
            if status == "closing":
                return error_response("mock engine is shutting down", "InternalServerError", 503)
            if status == "abort":
                # Tokens "generated" before the abort arrived.
                spent_ms = (time.monotonic() - start) * 1000 - config.ttft_ms
                done = int(spent_ms // config.token_delay_ms) if config.token_delay_ms > 0 else 0
                done = max(0, min(done, completion.completion_tokens - 1))
                completion = generator.aborted(completion, done)
                state.aborted += 1
            out = Outcome(completion, cached, state.weight_version, time.monotonic() - received)
            reply = await anyio.to_thread.run_sync(build_reply, req, out, state)
        finally:
            state.in_flight -= 1
            state.running.pop(req.rid, None)
        state.tokens_generated += completion.completion_tokens
        return PartsResponse(reply)

    def _prepare(
        body: dict[str, Any], headers: dict[str, str]
    ) -> tuple[ChatRequest, Completion, int]:
        req = parse_chat(body, headers, state)
        completion = generator.generate(
            req.prompt_ids,
            request_seed=req.seed,
            max_tokens=req.max_tokens,
            tools=req.tools,
            reasoning=req.reasoning,
            variant=req.lora or "",
        )
        try:
            after = state.abort_next.popleft()
        except IndexError:
            after = None
        if after is not None and after < completion.completion_tokens:
            completion = generator.aborted(completion, after)
            state.aborted += 1
        # The radix cache keeps what had KV computed: the prompt and all but the last token.
        sequence = req.prompt_ids + completion.ids[:-1]
        cached = state.prefix_cache.lookup_and_insert(
            req.prompt_ids, sequence, namespace=req.lora or ""
        )
        return req, completion, cached

    async def health(request: Request) -> Response:
        # http_server.py `health_generate` (also GET /health): a 200 with an empty body once
        # the engine answers (SGLang probes it with a one-token generation first).
        return Response(status_code=200)

    async def models(request: Request) -> Response:
        model = {"id": config.model_name, "object": "model", "created": 0, "owned_by": "mock"}
        return _json({"object": "list", "data": [model]})

    async def model_info(request: Request) -> Response:
        return _json(
            {
                "model_path": config.model_name,
                "served_model_name": config.model_name,
                "is_generation": True,
                "weight_version": state.weight_version,
                "reasoning_parser": config.reasoning_parser,
                "tool_call_parser": config.tool_call_parser,
            }
        )

    async def abort_request(request: Request) -> Response:
        # http_server.py `/abort_request` -> tokenizer_manager.abort_request: rid prefix
        # match (scheduler.py), or every request with abort_all; 200 with an empty body.
        body = await _json_body(request)
        if not isinstance(body, dict):
            error = {"type": "model_type", "loc": ("body",), "msg": "Input should be an object"}
            return _validation_error([error]).response()
        rid = body.get("rid") or ""
        abort_all = body.get("abort_all") is True
        for running_rid, event in list(state.running.items()):
            if abort_all or (rid and running_rid.startswith(rid)):
                event.set()
        return Response(status_code=200)

    async def update_weight_version(request: Request) -> Response:
        # http_server.py `/update_weight_version` (UpdateWeightVersionReqInput).
        body = await _json_body(request)
        new = body.get("new_version") if isinstance(body, dict) else None
        if not isinstance(new, str) or not new:
            return _validation_error(
                [{"type": "missing", "loc": ("body", "new_version"), "msg": "Field required"}]
            ).response()
        if body.get("abort_all_requests", True) is not False:
            for event in state.running.values():
                event.set()
        state.weight_version = new
        return _json(
            {"success": True, "message": f"Weight version updated to {new}", "new_version": new}
        )

    async def abort_next(request: Request) -> Response:
        body = await _json_body(request)
        after = body.get("after_tokens", 0) if isinstance(body, dict) else None
        if type(after) is not int or after < 0:
            return error_response("after_tokens must be an integer >= 0", "BadRequestError", 400)
        state.abort_next.append(after)
        return _json({"pending": len(state.abort_next)})

    async def recent_requests(request: Request) -> Response:
        last_raw = request.query_params.get("last")
        last = len(state.recent)
        if last_raw is not None:
            if not last_raw.isdigit():
                return error_response("last must be a non-negative integer", "BadRequestError", 400)
            last = min(int(last_raw), len(state.recent))
        picked = list(state.recent)[len(state.recent) - last :] if last else []
        headers = list(state.recent_headers)[len(state.recent_headers) - last :] if last else []
        # The stored raw bodies are valid JSON objects already: splice, don't re-encode.
        body = (
            b'{"requests":['
            + b",".join(picked)
            + b'],"headers":'
            + json.dumps(headers).encode()
            + b"}"
        )
        return Response(body, media_type="application/json")

    async def stats(request: Request) -> Response:
        return _json({**state.stats(), "prefix_cache": state.prefix_cache.stats()})

    routes = [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/model_info", model_info, methods=["GET"]),
        Route("/abort_request", abort_request, methods=["POST"]),
        Route("/update_weight_version", update_weight_version, methods=["POST"]),
        Route("/mock/abort_next", abort_next, methods=["POST"]),
        Route("/mock/requests", recent_requests, methods=["GET"]),
        Route("/mock/stats", stats, methods=["GET"]),
    ]
    app = Starlette(routes=routes)
    app.state.engine = state
    return app

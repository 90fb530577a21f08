"""Starlette app of the mock engine: the upstream chat contract plus test introspection.

Heavy work (prompt validation/tokenization, generation, R3 bytes, JSON assembly) runs in a
worker thread so `/health` keeps answering while a 100 MiB reply is being built.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import anyio.to_thread
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from sessiongate.mock_engine.config import MockEngineConfig
from sessiongate.mock_engine.generate import (
    R3_POOL_CHUNK_B64,
    Completion,
    CompletionGenerator,
    TokenizerLike,
    r3_pool_rows,
    routed_experts_b64_parts,
)

# A body slice: bytes, or a read-only view into the shared R3 pool.
Part: TypeAlias = bytes | memoryview

RECENT_REQUESTS = 256
# Large bodies go out in slices this big: each send blocks the event loop only briefly and
# uvicorn's flow control paces them (one 80 MiB write would be copied into asyncio's buffer).
# The R3 pool's chunks are at most this big, so they go out as they are (see `_send_slices`).
SEND_SLICE = R3_POOL_CHUNK_B64
# Stands in for the R3 string while the small rest of the reply goes through json.dumps; the
# base64 bytes are spliced in afterwards (json.dumps of an 80 MiB string is pure waste).
_R3_PLACEHOLDER = "@@sessiongate-mock-routed-experts@@"
_R3_SLOT = json.dumps(_R3_PLACEHOLDER).encode()


class BadRequest(Exception):
    """The request body breaks the contract; answered with 400 and this message."""


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """What the engine needs from a validated chat body."""

    prompt_ids: list[int]
    seed: int | None
    max_tokens: int | None
    tools: list[Any] | None
    stream: bool
    want_meta: bool
    want_logprobs: bool
    want_r3: bool
    model: str


@dataclass(slots=True)
class EngineState:
    config: MockEngineConfig
    tokenizer: TokenizerLike
    generator: CompletionGenerator
    recent: deque[bytes] = field(default_factory=lambda: deque(maxlen=RECENT_REQUESTS))
    # The headers of the same requests (a capture for session-routing tests).
    recent_headers: deque[dict[str, str]] = field(
        default_factory=lambda: deque(maxlen=RECENT_REQUESTS)
    )
    # Set on shutdown: pending delays end at once so uvicorn's graceful shutdown is quick.
    closing: asyncio.Event = field(default_factory=asyncio.Event)
    requests: int = 0
    failures: int = 0
    bad_requests: int = 0
    streams: int = 0
    in_flight: int = 0
    prompt_tokens: int = 0
    tokens_generated: int = 0

    def stats(self) -> dict[str, int]:
        return {
            "requests": self.requests,
            "failures": self.failures,
            "bad_requests": self.bad_requests,
            "streams": self.streams,
            "in_flight": self.in_flight,
            "prompt_tokens": self.prompt_tokens,
            "tokens_generated": self.tokens_generated,
        }


def _json(payload: Any, status: int = 200) -> Response:
    body = json.dumps(payload, separators=(",", ":")).encode()
    return Response(body, status_code=status, media_type="application/json")


def _error(message: str, status: int) -> Response:
    return _json({"error": message}, status)


def _opt_int(body: dict[str, Any], name: str, minimum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not int:
        raise BadRequest(f"{name} must be an integer")
    if minimum is not None and value < minimum:
        raise BadRequest(f"{name} must be >= {minimum}")
    return value


def _prompt_ids(body: dict[str, Any], tokenizer: TokenizerLike) -> list[int]:
    if "input_ids" in body:
        ids = body["input_ids"]
        if not isinstance(ids, list) or not ids:
            raise BadRequest("input_ids must be a non-empty list of token ids")
        if not all(type(i) is int for i in ids):
            raise BadRequest("input_ids must contain only integers")
        low, high = min(ids), max(ids)
        if low < 0 or high >= tokenizer.vocab_size:
            raise BadRequest(f"input_ids out of range [0, {tokenizer.vocab_size})")
        return ids
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list (or send input_ids)")
    if not all(isinstance(m, dict) for m in messages):
        raise BadRequest("every message must be an object")
    try:
        ids = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            messages, add_generation_prompt=True, tools=body.get("tools")
        )
    except Exception as exc:  # a template error is the caller's malformed message
        raise BadRequest(f"cannot render messages with the chat template: {exc}") from exc
    return list(ids)


def parse_chat(body: dict[str, Any], state: EngineState) -> ChatRequest:
    """Validate a chat body and resolve its prompt ids (runs in a worker thread)."""
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("tools must be a list")
    max_tokens = _opt_int(body, "max_tokens", 1)
    max_completion = _opt_int(body, "max_completion_tokens", 1)
    caps = [c for c in (max_tokens, max_completion) if c is not None]
    want_logprobs = body.get("logprobs") is True
    model = body.get("model")
    return ChatRequest(
        prompt_ids=_prompt_ids(body, state.tokenizer),
        seed=_opt_int(body, "seed"),
        max_tokens=min(caps) if caps else None,
        tools=tools,
        stream=body.get("stream") is True,
        want_meta=body.get("return_meta_info") is True or want_logprobs,
        want_logprobs=want_logprobs,
        want_r3=body.get("return_routed_experts") is True and state.config.r3_enabled,
        model=model if isinstance(model, str) and model else state.config.model_name,
    )


def meta_info(
    completion: Completion, request_id: str, *, with_r3: bool, cfg: MockEngineConfig
) -> tuple[dict[str, Any], list[Part] | None]:
    """SGLang-style `meta_info` dict, and the R3 base64 slices to splice in (if asked)."""
    meta: dict[str, Any] = {
        "id": request_id,
        "finish_reason": completion.meta_finish_reason,
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion.completion_tokens,
        "cached_tokens": 0,
        "weight_version": "default",
        "output_token_logprobs": completion.output_token_logprobs(),
    }
    r3: list[Part] | None = None
    if with_r3:
        rows = completion.prompt_tokens + completion.completion_tokens - 1
        r3 = routed_experts_b64_parts(
            completion.key, rows, cfg.r3_layers, cfg.r3_topk, cfg.r3_experts
        )
        meta["routed_experts"] = _R3_PLACEHOLDER
    return meta, r3


def dumps_with_r3(payload: Any, r3: list[Part] | None) -> list[Part]:
    """Compact JSON of `payload` as byte slices, the R3 placeholder replaced by `r3`.

    The first and last slices are always `bytes` (the JSON around the R3 string).
    """
    body = json.dumps(payload, separators=(",", ":")).encode()
    if r3 is None:
        return [body]
    head, tail = body.split(_R3_SLOT, 1)
    return [head + b'"', *r3, b'"' + tail]


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


def _openai_logprobs(
    tokenizer: TokenizerLike, completion: Completion, start: int, stop: int
) -> dict[str, Any]:
    content = []
    for i in range(start, stop):
        text = tokenizer.decode([completion.ids[i]])
        content.append(
            {
                "token": text,
                "logprob": completion.logprobs[i],
                "bytes": list(text.encode()),
                "top_logprobs": [],
            }
        )
    return {"content": content}


def _usage(completion: Completion) -> dict[str, int]:
    return {
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion.completion_tokens,
        "total_tokens": completion.prompt_tokens + completion.completion_tokens,
    }


def _matched_stop(completion: Completion) -> int | None:
    # SGLang reports the stop token here, and None once a tool-call parser rewrote the reason.
    if completion.finish_reason == "stop":
        matched: int = completion.meta_finish_reason["matched"]
        return matched
    return None


def build_reply(
    req: ChatRequest, completion: Completion, state: EngineState, request_id: str
) -> list[Part]:
    """The whole non-stream reply body (runs in a worker thread)."""
    message: dict[str, Any] = {"role": "assistant", "content": completion.content}
    if completion.tool_call is not None:
        message["tool_calls"] = [completion.tool_call.to_openai()]
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": completion.finish_reason,
        "matched_stop": _matched_stop(completion),
    }
    if req.want_logprobs:
        choice["logprobs"] = _openai_logprobs(
            state.tokenizer, completion, 0, completion.completion_tokens
        )
    r3: list[Part] | None = None
    if req.want_meta or req.want_r3:
        choice["meta_info"], r3 = meta_info(
            completion, request_id, with_r3=req.want_r3, cfg=state.config
        )
    payload = {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": [choice],
        "usage": _usage(completion),
    }
    return dumps_with_r3(payload, r3)


def _sse(payload: Any, r3: list[Part] | None = None) -> list[Part]:
    parts = dumps_with_r3(payload, r3)
    parts[0] = b"data: " + parts[0]
    parts[-1] = bytes(parts[-1]) + b"\n\n"  # bytes already (the JSON tail): no copy of R3
    return parts


async def _stream_events(
    req: ChatRequest, completion: Completion, state: EngineState, request_id: str
) -> AsyncIterator[Part]:
    cfg = state.config
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None, **extra: Any) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish,
            **extra,
        }
        return {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": req.model,
            "choices": [choice],
        }

    state.in_flight += 1
    try:
        yield _sse(chunk({"role": "assistant", "content": ""}, None))[0]
        if not await _pause(state, cfg.ttft_ms / 1000):
            return  # shutting down: end the stream early, like an engine going away
        pieces = await anyio.to_thread.run_sync(
            state.generator.stream_pieces, completion, cfg.stream_chunk_tokens
        )
        for piece in pieces:
            delay = cfg.token_delay_ms * (piece.stop - piece.start) / 1000
            if not await _pause(state, delay):
                return
            delta: dict[str, Any] = {}
            if piece.content:
                delta["content"] = piece.content
            if piece.tool_call is not None:
                delta["tool_calls"] = [{"index": 0, **piece.tool_call.to_openai()}]
            extra: dict[str, Any] = {}
            if req.want_meta:
                extra["meta_info"] = {
                    "output_token_logprobs": completion.output_token_logprobs(
                        piece.start, piece.stop
                    )
                }
            payload = chunk(delta, None, **extra)
            if req.want_logprobs:
                payload["choices"][0]["logprobs"] = _openai_logprobs(
                    state.tokenizer, completion, piece.start, piece.stop
                )
            yield _sse(payload)[0]

        def final() -> list[Part]:
            extra: dict[str, Any] = {"matched_stop": _matched_stop(completion)}
            r3: list[Part] | None = None
            if req.want_meta or req.want_r3:
                extra["meta_info"], r3 = meta_info(
                    completion, request_id, with_r3=req.want_r3, cfg=cfg
                )
            payload = chunk({}, completion.finish_reason, **extra)
            payload["usage"] = _usage(completion)
            return _sse(payload, r3)

        for chunk in _send_slices(await anyio.to_thread.run_sync(final)):
            yield chunk
        yield b"data: [DONE]\n\n"
        state.tokens_generated += completion.completion_tokens
    finally:
        state.in_flight -= 1


async def _pause(state: EngineState, seconds: float) -> bool:
    """Sleep `seconds`; False (at once) if the engine starts shutting down meanwhile."""
    if seconds <= 0:
        return not state.closing.is_set()
    try:
        await asyncio.wait_for(state.closing.wait(), seconds)
    except TimeoutError:
        return True
    return False


def _fail_roll(seed: int, counter: int) -> float:
    digest = hashlib.blake2b(f"{seed}|fail|{counter}".encode(), digest_size=16).digest()
    return random.Random(digest).random()


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
    )
    state = EngineState(config, tokenizer, generator)
    if config.r3_enabled:
        # Build the R3 pool now (~10 ms) rather than inside the first R3 reply.
        r3_pool_rows(config.r3_layers, config.r3_topk, config.r3_experts)

    async def chat(request: Request) -> Response:
        state.requests += 1
        counter = state.requests
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            state.bad_requests += 1
            return _error(f"invalid JSON body: {exc}", 400)
        if not isinstance(body, dict):
            state.bad_requests += 1
            return _error("request body must be a JSON object", 400)
        state.recent.append(raw)
        state.recent_headers.append(dict(request.headers.items()))

        forced = request.headers.get("x-mock-fail")
        if forced is not None:
            if not forced.strip().isdigit() or not 400 <= int(forced) <= 599:
                state.bad_requests += 1
                return _error("X-Mock-Fail must be an HTTP error status (400..599)", 400)
            state.failures += 1
            return _error("injected failure", int(forced))
        if config.fail_rate > 0 and _fail_roll(config.seed, counter) < config.fail_rate:
            state.failures += 1
            return _error("injected failure", config.fail_status)

        request_id = "chatcmpl-" + uuid.uuid4().hex
        try:
            req, completion = await anyio.to_thread.run_sync(_prepare, body)
        except BadRequest as exc:
            state.bad_requests += 1
            return _error(str(exc), 400)
        state.prompt_tokens += completion.prompt_tokens

        if req.stream:
            state.streams += 1
            return StreamingResponse(
                _stream_events(req, completion, state, request_id),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        state.in_flight += 1
        try:
            delay_ms = config.ttft_ms + config.token_delay_ms * completion.completion_tokens
            if not await _pause(state, delay_ms / 1000):
                return _error("mock engine is shutting down", 503)
            reply = await anyio.to_thread.run_sync(build_reply, req, completion, state, request_id)
        finally:
            state.in_flight -= 1
        state.tokens_generated += completion.completion_tokens
        return PartsResponse(reply)

    def _prepare(body: dict[str, Any]) -> tuple[ChatRequest, Completion]:
        req = parse_chat(body, state)
        completion = generator.generate(
            req.prompt_ids, request_seed=req.seed, max_tokens=req.max_tokens, tools=req.tools
        )
        return req, completion

    async def health(request: Request) -> Response:
        return _json({"status": "ok"})

    async def models(request: Request) -> Response:
        model = {"id": config.model_name, "object": "model", "created": 0, "owned_by": "mock"}
        return _json({"object": "list", "data": [model]})

    async def recent_requests(request: Request) -> Response:
        last_raw = request.query_params.get("last")
        last = len(state.recent)
        if last_raw is not None:
            if not last_raw.isdigit():
                return _error("last must be a non-negative integer", 400)
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
        return _json(state.stats())

    routes = [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/mock/requests", recent_requests, methods=["GET"]),
        Route("/mock/stats", stats, methods=["GET"]),
    ]
    app = Starlette(routes=routes)
    app.state.engine = state
    return app

"""Starlette app of the mock engine: the routes, admin and fault injection, and `create_app`.

The chat route answers SGLang 0.5.23's OpenAI chat contract (see docs/mock-engine.md for the
source of every shape) by putting together `chat_request` (what is refused), `reply` (the
non-stream body) and `stream` (the SSE chunks); `responses_api` answers `/v1/responses`
through that route. Beside it: SGLang's own `/health`, `/v1/models`, `/model_info`,
`/abort_request` and `/update_weight_version`, the generation control routes of `control`
(pause, continue, readiness, weight updates), and the mock's `/mock/*` introspection and
fault-injection routes (plus `X-Mock-Fail` and `--fail-rate`).

Heavy work (prompt validation/tokenization, generation, R3 bytes, JSON assembly) runs in a
worker thread so `/health` keeps answering while a 100 MiB reply is being built.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio.to_thread
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from sessiongate.mock_engine.body_slices import Part, PartsResponse, json_response
from sessiongate.mock_engine.chat_request import (
    ApiError,
    ChatRequest,
    error_response,
    parse_chat,
    validation_error,
)
from sessiongate.mock_engine.completion import Completion
from sessiongate.mock_engine.config import MockEngineConfig
from sessiongate.mock_engine.control import ControlRoutes
from sessiongate.mock_engine.generate import CompletionGenerator
from sessiongate.mock_engine.messages import MessagesRoute
from sessiongate.mock_engine.native import NativeRoutes, cache_namespace
from sessiongate.mock_engine.prefix_cache import PrefixCache
from sessiongate.mock_engine.reply import Outcome, build_reply
from sessiongate.mock_engine.responses_api import ResponsesRoute
from sessiongate.mock_engine.routed_experts import r3_pool_rows
from sessiongate.mock_engine.scheduler import Job, StepScheduler
from sessiongate.mock_engine.state import EngineState, interruptible_sleep
from sessiongate.mock_engine.stream import stream_events
from sessiongate.mock_engine.tokens import TokenizerLike


def _injected(status: int) -> ApiError:
    kind = "InternalServerError" if status >= 500 else "BadRequestError"
    return ApiError("injected failure", kind, status)


def _fail_roll(seed: int, counter: int) -> float:
    digest = hashlib.blake2b(f"{seed}|fail|{counter}".encode(), digest_size=16).digest()
    return random.Random(digest).random()


Handler = Callable[[Request], Awaitable[Response]]


def _counted(state: EngineState, route: str, handler: Handler) -> Handler:
    """`handler`, counting the requests that arrive while the engine is paused (/mock/stats
    `arrived_while_paused`). Only the routes a client calls are wrapped: /v1/messages calls
    the chat handler itself, which must not count its request twice."""

    async def counted(request: Request) -> Response:
        state.note_arrival(route)
        return await handler(request)

    return counted


async def _json_body(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None


def create_app(config: MockEngineConfig, tokenizer: TokenizerLike | None = None) -> Starlette:
    """The mock engine as an ASGI app. `tokenizer` overrides `config.tokenizer` (tests)."""
    if tokenizer is None:
        from sessiongate.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(config.tokenizer, sglang_rules=config.sglang_rules)
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
    scheduler: StepScheduler | None = None
    if config.step_scheduler:
        scheduler = StepScheduler(
            config,
            state.prefix_cache,
            state.closing,
            on_admit=lambda job: state.count_prompt(len(job.prompt), job.cached, job.adapter),
            progress=state.progress,
        )
    if config.r3_enabled:
        # Build the R3 pool now (~10 ms) rather than inside the first R3 reply.
        r3_pool_rows(config.r3_layers, config.r3_topk, config.r3_experts)

    chat = OpenAIChatRoute(config, state, generator, scheduler)
    responses = ResponsesRoute(chat)
    server = SGLangServerRoutes(config, state)
    native = NativeRoutes(state, scheduler)
    mock = MockAdminRoutes(state, scheduler)
    control = ControlRoutes(state, scheduler)
    messages = MessagesRoute(config, state, chat.chat)

    def generation(path: str, handler: Handler, methods: list[str]) -> Route:
        return Route(path, _counted(state, path, handler), methods=methods)

    routes = [
        generation("/v1/chat/completions", chat.chat, ["POST"]),
        generation("/v1/responses", responses.responses, ["POST"]),
        generation("/v1/messages", messages.messages, ["POST"]),
        Route("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"]),
        generation("/generate", native.generate, ["POST", "PUT"]),
        Route("/flush_cache", native.flush_cache, methods=["GET", "POST"]),
        Route("/v1/loads", native.loads, methods=["GET"]),
        Route("/metrics", native.metrics, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/health_generate", control.health_generate, methods=["GET"]),
        Route("/ready", control.ready, methods=["GET"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/model_info", server.model_info, methods=["GET"]),
        Route("/get_model_info", server.model_info, methods=["GET"]),
        Route("/server_info", server.server_info, methods=["GET"]),
        Route("/get_server_info", server.server_info, methods=["GET"]),
        Route("/abort_request", server.abort_request, methods=["POST"]),
        Route("/update_weight_version", server.update_weight_version, methods=["POST"]),
        Route("/update_weights_from_disk", control.update_weights_from_disk, methods=["POST"]),
        Route("/pause_generation", control.pause_generation, methods=["POST"]),
        Route("/continue_generation", control.continue_generation, methods=["POST"]),
        Route("/mock/abort_next", mock.abort_next, methods=["POST"]),
        Route("/mock/requests", mock.recent_requests, methods=["GET"]),
        Route("/mock/stats", mock.stats, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _not_found})
    app.state.engine = state
    return app


@dataclass(frozen=True, slots=True)
class _AdmittedChat:
    """A chat request past the refusals: its completion, prefix-cache hit, abort event and
    step-scheduler job (None when sleeps pace it)."""

    req: ChatRequest
    completion: Completion
    cached: int
    abort: asyncio.Event
    job: Job | None


# eq=False: the route objects keep identity equality and hashing, as plain classes have.
@dataclass(eq=False)
class OpenAIChatRoute:
    """`/v1/chat/completions`: refusals, fault injection, generation, pacing and the reply."""

    config: MockEngineConfig
    state: EngineState
    generator: CompletionGenerator
    scheduler: StepScheduler | None

    async def chat(self, request: Request) -> Response:
        state = self.state
        state.requests += 1
        counter = state.requests
        received = time.monotonic()
        try:
            body = await self.read_body(request)
            admitted = await self.admit(request, body, counter)
        except ApiError as exc:
            return exc.response()
        if admitted.req.stream:
            return await self._stream(admitted)
        return await self._reply(admitted, received)

    async def admit(self, request: Request, body: dict[str, Any], counter: int) -> _AdmittedChat:
        """Inject the failure asked for (`counter`: the request's number), then prepare and
        submit the chat body; a refusal raises ApiError (the `/v1/responses` route renders it
        in its own envelope)."""
        state = self.state
        injected = self._injected_failure(request, counter)
        if injected is not None:
            raise injected

        headers = {k.lower(): v for k, v in request.headers.items()}
        try:
            req, completion, cached = await anyio.to_thread.run_sync(self._prepare, body, headers)
        except ApiError:
            state.bad_requests += 1
            raise
        state.prompt_tokens += completion.prompt_tokens
        # tokenizer_manager.py `generate_request`: a valid request waits here while the
        # engine is paused (or a weight update drains); registered in the same step as it
        # passes, so a pause's abort_all cannot miss it.
        if await state.pass_gate() == "closing":
            raise ApiError("mock engine is shutting down", "InternalServerError", 503)
        abort = asyncio.Event()
        state.running[req.rid] = abort
        job = self._submit(req, completion, cached, abort)
        return _AdmittedChat(req, completion, cached, abort, job)

    async def read_body(self, request: Request) -> dict[str, Any]:
        """The JSON object of the request (recorded for /mock/requests); ApiError: the 400
        refusing it."""
        state = self.state
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
            raise validation_error(
                [{"loc": ("header", "content-type"), "msg": msg, "type": "value_error"}]
            )
        if not isinstance(body, dict):
            state.bad_requests += 1
            kind = "json_invalid" if isinstance(body, Exception) else "model_attributes_type"
            raise validation_error(
                [{"type": kind, "loc": ("body",), "msg": f"Invalid request body: {kind}"}]
            )
        return body

    def _injected_failure(self, request: Request, counter: int) -> ApiError | None:
        """The failure `X-Mock-Fail` or `--fail-rate` asks for, if any."""
        state = self.state
        config = self.config
        forced = request.headers.get("x-mock-fail")
        if forced is not None:
            if not forced.strip().isdigit() or not 400 <= int(forced) <= 599:
                state.bad_requests += 1
                return ApiError("X-Mock-Fail must be an HTTP error status (400..599)")
            state.failures += 1
            return _injected(int(forced))
        if config.fail_rate > 0 and _fail_roll(config.seed, counter) < config.fail_rate:
            state.failures += 1
            return _injected(config.fail_status)
        return None

    def _prepare(
        self, body: dict[str, Any], headers: dict[str, str]
    ) -> tuple[ChatRequest, Completion, int]:
        state = self.state
        generator = self.generator
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
        if self.scheduler is not None:
            return req, completion, 0  # the scheduler matches it at admission
        # The radix cache keeps what had KV computed: the prompt and all but the last token.
        sequence = req.prompt_ids + completion.ids[:-1]
        cached = state.prefix_cache.lookup_and_insert(
            req.prompt_ids, sequence, namespace=cache_namespace(None, req.lora, None)
        )
        return req, completion, cached

    def _submit(
        self, req: ChatRequest, completion: Completion, cached: int, abort: asyncio.Event
    ) -> Job | None:
        """The step scheduler's job for this request, or None when it is paced by sleeps."""
        if self.scheduler is not None and req.abort_message is None:
            job = Job(
                req.prompt_ids,
                completion.ids,
                cache_namespace(None, req.lora, None),
                abort,
                req.lora,
            )
            self.scheduler.submit(job)
            return job
        self.state.count_prompt(completion.prompt_tokens, cached, req.lora)
        return None

    async def _stream(self, admitted: _AdmittedChat) -> Response:
        state = self.state
        state.streams += 1
        events = stream_events(
            admitted.req,
            admitted.completion,
            admitted.cached,
            state,
            admitted.abort,
            self.scheduler,
            admitted.job,
        )
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

    async def _reply(self, admitted: _AdmittedChat, received: float) -> Response:
        """The non-stream reply, once the scheduler or the sleeps say it is generated."""
        try:
            return PartsResponse(await self.reply_parts(admitted, received))
        except ApiError as exc:
            return exc.response()

    async def reply_parts(self, admitted: _AdmittedChat, received: float) -> list[Part]:
        """The non-stream reply's JSON parts; ApiError (503) when the engine shuts down."""
        req, job = admitted.req, admitted.job
        # Both change below: an abort shortens the completion, the scheduler finds the hit.
        completion, cached = admitted.completion, admitted.cached
        state = self.state
        config = self.config
        scheduler = self.scheduler
        state.flight(+1)
        try:
            start = state.clock()  # generation time: a halted scheduler's pause is not in it
            if scheduler is not None and job is not None:
                status = await scheduler.wait(job, completion.completion_tokens)
                cached = job.cached
            else:
                delay_ms = config.ttft_ms + config.token_delay_ms * completion.completion_tokens
                status = await interruptible_sleep(state, delay_ms / 1000, admitted.abort)
            if status == "closing":
                raise ApiError("mock engine is shutting down", "InternalServerError", 503)
            if status == "abort" and job is not None:
                done = max(0, min(job.done, completion.completion_tokens - 1))
                completion = self.generator.aborted(completion, done)
                state.aborted += 1
            elif status == "abort":
                # Tokens "generated" before the abort arrived.
                spent_ms = (state.clock() - start) * 1000 - config.ttft_ms
                done = int(spent_ms // config.token_delay_ms) if config.token_delay_ms > 0 else 0
                done = max(0, min(done, completion.completion_tokens - 1))
                completion = self.generator.aborted(completion, done)
                state.aborted += 1
            out = Outcome(completion, cached, state.weight_version, time.monotonic() - received)
            reply = await anyio.to_thread.run_sync(build_reply, req, out, state)
        finally:
            state.flight(-1)
            state.running.pop(req.rid, None)
        state.tokens_generated += completion.completion_tokens
        return reply


@dataclass(eq=False)
class SGLangServerRoutes:
    """SGLang http_server.py's health, model and control routes (/generate is NativeRoutes)."""

    config: MockEngineConfig
    state: EngineState

    async def health(self, request: Request) -> Response:
        # http_server.py `health_generate` (also GET /health): a 200 with an empty body once
        # the engine answers (SGLang probes it with a one-token generation first).
        return Response(status_code=200)

    async def models(self, request: Request) -> Response:
        # http_server.py `available_models`: the served model name, which a weight update
        # from disk moves (tokenizer_manager.py `_update_model_path_info`).
        served = self.state.served_model_name
        model = {"id": served, "object": "model", "created": 0, "owned_by": "mock"}
        return json_response({"object": "list", "data": [model]})

    async def model_info(self, request: Request) -> Response:
        # http_server.py `model_info` (and the deprecated `/get_model_info`): model_path and
        # served_model_name are what the last weight update from disk loaded, and
        # weight_version the one in effect (tokenizer_manager.py `config_value`).
        config = self.config
        state = self.state
        return json_response(
            {
                "model_path": state.served_model_name,
                "served_model_name": state.served_model_name,
                "is_generation": True,
                "weight_version": self.state.weight_version,
                "reasoning_parser": config.reasoning_parser,
                "tool_call_parser": config.tool_call_parser,
            }
        )

    async def server_info(self, request: Request) -> Response:
        # http_server.py `server_info` (and the deprecated `/get_server_info`): the server
        # arguments, scheduler info, internal states and `version` (sglang/version.py).
        # The mock's subset: the arguments it has, and the version it stands in for. As in
        # SGLang these are the startup arguments: what a weight update or
        # /update_weight_version changes is reported by /model_info (server_info's docstring).
        config = self.config
        return json_response(
            {
                "model_path": config.model_name,
                "tokenizer_path": config.tokenizer,
                "served_model_name": config.model_name,
                "host": config.host,
                "port": config.port,
                "random_seed": config.seed,
                "reasoning_parser": config.reasoning_parser,
                "tool_call_parser": config.tool_call_parser,
                "weight_version": config.weight_version,
                "internal_states": [],
                "version": config.sglang_version,
            }
        )

    async def abort_request(self, request: Request) -> Response:
        # http_server.py `/abort_request` -> tokenizer_manager.abort_request: rid prefix
        # match (scheduler.py), or every request with abort_all; 200 with an empty body.
        body = await _json_body(request)
        if not isinstance(body, dict):
            error = {"type": "model_type", "loc": ("body",), "msg": "Input should be an object"}
            return validation_error([error]).response()
        rid = body.get("rid") or ""
        abort_all = body.get("abort_all") is True
        for running_rid, event in list(self.state.running.items()):
            if abort_all or (rid and running_rid.startswith(rid)):
                event.set()
        return Response(status_code=200)

    async def update_weight_version(self, request: Request) -> Response:
        # http_server.py `/update_weight_version` (UpdateWeightVersionReqInput).
        state = self.state
        body = await _json_body(request)
        new = body.get("new_version") if isinstance(body, dict) else None
        if not isinstance(new, str) or not new:
            return validation_error(
                [{"type": "missing", "loc": ("body", "new_version"), "msg": "Field required"}]
            ).response()
        if body.get("abort_all_requests", True) is not False:
            state.abort_all()
        state.weight_version = new
        return json_response(
            {"success": True, "message": f"Weight version updated to {new}", "new_version": new}
        )


@dataclass(eq=False)
class MockAdminRoutes:
    """The mock's own /mock/* routes: abort scheduling, recorded requests, counters."""

    state: EngineState
    scheduler: StepScheduler | None

    async def abort_next(self, request: Request) -> Response:
        state = self.state
        body = await _json_body(request)
        after = body.get("after_tokens", 0) if isinstance(body, dict) else None
        if type(after) is not int or after < 0:
            return error_response("after_tokens must be an integer >= 0", "BadRequestError", 400)
        state.abort_next.append(after)
        return json_response({"pending": len(state.abort_next)})

    async def recent_requests(self, request: Request) -> Response:
        state = self.state
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

    async def stats(self, request: Request) -> Response:
        state = self.state
        scheduler = self.scheduler
        return json_response(
            {
                **state.stats(),
                **state.pause_stats(),
                "prefix_cache": state.prefix_cache.stats(),
                "cached_tokens": state.cached_tokens,
                "prefilled_tokens": state.prefilled_tokens,
                "adapter_requests": dict(state.adapter_requests),
                "in_flight_avg": round(state.in_flight_avg(), 6),
                "scheduler_steps": scheduler.steps if scheduler is not None else 0,
                "busy_us": scheduler.total_busy_us if scheduler is not None else 0,
            }
        )


async def _not_found(request: Request, exc: Exception) -> Response:
    # FastAPI's default HTTPException handler (SGLang's own handler is registered for
    # fastapi.HTTPException, which the router's starlette exception is not):
    # {"detail": "Not Found"} as JSON, e.g. for the Gateway's GET /get_load.
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    detail = exc.detail if isinstance(exc, HTTPException) else "Internal Server Error"
    return json_response({"detail": detail}, status)

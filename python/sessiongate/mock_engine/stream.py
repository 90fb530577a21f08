"""The streamed chat reply: SSE chunks per engine step, the finish, sglext and usage chunks.

Follows SGLang 0.5.23's `entrypoints/openai/serving_chat.py` (`_generate_chat_stream`,
`_generate_stream_content`, `_process_tool_call_stream`) and `sse_utils.py`
(`build_sse_content`): which chunk builder each chunk comes from, when a step sends nothing,
when its logprobs get a chunk of their own, and where ids and R3 rows go.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import anyio.to_thread

from sessiongate.mock_engine.body_slices import Part, dumps_spliced, send_slices
from sessiongate.mock_engine.chat_request import ChatRequest
from sessiongate.mock_engine.completion import Completion, StreamPiece
from sessiongate.mock_engine.reply import (
    ROUTED_EXPERTS_PLACEHOLDER,
    cached_tokens_details,
    choice_finish,
    choice_logprobs,
    routed_experts_parts,
    usage_info,
)
from sessiongate.mock_engine.scheduler import Job, StepScheduler
from sessiongate.mock_engine.state import EngineState, interruptible_sleep


class _StreamChunks:
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
    chunks: _StreamChunks, req: ChatRequest, completion: Completion, piece: StreamPiece, flush: bool
) -> list[bytes]:
    """The chunks of one engine step (serving_chat.py `_generate_stream_content`). `flush`:
    the engine runs a reasoning or tool-call parser."""
    events: list[bytes] = []
    logprobs = choice_logprobs(completion, piece.start, piece.stop) if req.want_logprobs else None
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


async def stream_events(
    req: ChatRequest,
    completion: Completion,
    cached: int,
    state: EngineState,
    abort: asyncio.Event,
    scheduler: StepScheduler | None = None,
    job: Job | None = None,
) -> AsyncIterator[Part]:
    """serving_chat.py `_generate_chat_stream`: the role chunk with the engine's first
    output, then per step its chunks, the finish chunk, the sglext chunk, the usage chunk
    (only with stream_options.include_usage), [DONE]. With the step scheduler (`job`) each
    step waits for the scheduler to have produced its tokens instead of sleeping."""
    cfg = state.config
    chunks = _StreamChunks(req, int(time.time()))
    # The tool-call path stands for an engine with a tool-call parser.
    flush = cfg.reasoning_parser is not None or cfg.tool_call_parser is not None
    flush = flush or req.tools is not None
    state.flight(+1)
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
            if scheduler is not None and job is not None:
                first = await scheduler.wait(job, min(1, completion.completion_tokens))
            else:
                first = await interruptible_sleep(state, cfg.ttft_ms / 1000, abort)
            if first == "closing":
                return  # shutting down: end the stream early, like an engine going away
            pieces = await anyio.to_thread.run_sync(
                state.generator.stream_pieces, completion, cfg.stream_chunk_tokens
            )
            for n, piece in enumerate(pieces):
                if n:
                    if scheduler is not None and job is not None:
                        status = await scheduler.wait(job, piece.stop)
                    else:
                        delay = cfg.token_delay_ms * (piece.stop - piece.start) / 1000
                        status = await interruptible_sleep(state, delay, abort)
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

        if job is not None:
            cached = job.cached  # matched when the scheduler admitted it
        finish, matched, _ = choice_finish(final, stream=True)
        yield chunks.content(finish=finish, matched_stop=matched)

        def tail() -> list[Part]:
            parts: list[Part] = []
            splices: dict[str, list[Part]] = {}
            non_ids: dict[str, Any] = {}
            if req.want_r3 and req.abort_message is None:
                non_ids["routed_experts"] = ROUTED_EXPERTS_PLACEHOLDER
                splices[ROUTED_EXPERTS_PLACEHOLDER] = routed_experts_parts(req, final, cfg)
            details = cached_tokens_details(req, cached)
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
                parts += chunks.response_level(usage=usage_info(final, cached, cfg))
            return parts

        for part in send_slices(await anyio.to_thread.run_sync(tail)):
            yield part
        yield b"data: [DONE]\n\n"
        state.tokens_generated += final.completion_tokens
    finally:
        state.flight(-1)
        state.running.pop(req.rid, None)

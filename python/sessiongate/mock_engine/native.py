"""SGLang's native routes on the mock: `/generate`, `/flush_cache`, `/v1/loads`.

`generate_api` says what a /generate body means and how its reply looks; this module runs
it: the fault hooks the chat route has, generation, pacing (the step scheduler, or the
chat route's ttft + per-token sleeps), the prefix cache, aborts, and the stream. `/flush_cache`
and `/v1/loads` answer from the same cache and scheduler, so a router reading loads sees
the work the engine really has.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from sessiongate.mock_engine.body_slices import Part, PartsResponse, dumps_spliced, send_slices
from sessiongate.mock_engine.chat_request import ApiError, error_response, validation_error
from sessiongate.mock_engine.completion import Completion
from sessiongate.mock_engine.generate_api import (
    ContractError,
    GenerateValueError,
    GenItem,
    apply_stops,
    meta_info,
    out_dict,
    parse_generate,
    r3_abort_meta,
)
from sessiongate.mock_engine.scheduler import Job, StepScheduler
from sessiongate.mock_engine.state import EngineState, interruptible_sleep

# http_server.py `flush_cache`: the reply text (plain, no media type) on success.
FLUSH_OK = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
FLUSH_FAILED = "Flush cache failed.\n"
FLUSH_TIMEOUT = "Timed out waiting for idle state."
# observability/metrics_collector.py: the help texts of the families the mock's /metrics has.
METRIC_HELP = (
    "The number of running requests.",
    "The number of requests in the waiting queue.",
    "The prefix cache hit rate.",
    "Number of prefill tokens processed.",
)
# prometheus_client's CONTENT_TYPE_LATEST (its text format 0.0.4).
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def cache_namespace(extra_key: str | None, lora: str | None, cache_salt: str | None) -> str:
    """The prefix-cache namespace of a request: schedule_batch.py `Req.__init__` appends the
    LoRA id to extra_key, and radix_cache.py keys by (extra_key, cache_salt), so prefixes
    are shared only between requests with the same extra_key, adapter and salt."""
    return f"{extra_key or ''}\0{lora or ''}\0{cache_salt or ''}"


def _sse(payload: Any, splices: dict[str, list[Part]] | None = None) -> list[Part]:
    parts = dumps_spliced(payload, splices or {})
    parts[0] = b"data: " + bytes(parts[0])
    parts[-1] = bytes(parts[-1]) + b"\n\n"
    return parts


@dataclass(slots=True)
class _InFlightPrompt:
    """One prompt of a /generate request on its way through the engine."""

    item: GenItem
    completion: Completion
    abort: asyncio.Event
    cached: int = 0
    job: Job | None = None


class NativeRoutes:
    """The handlers; one per app, sharing the chat route's state and scheduler."""

    def __init__(self, state: EngineState, scheduler: StepScheduler | None) -> None:
        self.state = state
        self.scheduler = scheduler

    # ---- /generate ----

    async def generate(self, request: Request) -> Response:
        state = self.state
        cfg = state.config
        state.requests += 1
        received = time.monotonic()
        raw = await request.body()
        # FastAPI reads a JSON body when the content type is absent or JSON (application/json
        # or application/*+json); any other body fails GenerateReqInput's validation.
        media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        is_json = (
            not media
            or media == "application/json"
            or (media.startswith("application/") and media.endswith("+json"))
        )
        try:
            body: Any = json.loads(raw) if is_json else None
        except (ValueError, RecursionError):
            body = ValueError
        if isinstance(body, dict):
            state.recent.append(raw)
            state.recent_headers.append(dict(request.headers.items()))
        if not isinstance(body, dict):
            state.bad_requests += 1
            kind = "json_invalid" if body is ValueError else "dataclass_type"
            return validation_error(
                [{"type": kind, "loc": ("body",), "msg": f"Invalid request body: {kind}"}]
            ).response()
        forced = request.headers.get("x-mock-fail")
        if forced is not None and forced.strip().isdigit() and 400 <= int(forced) <= 599:
            state.failures += 1
            kind = "InternalServerError" if int(forced) >= 500 else "BadRequestError"
            return error_response("injected failure", kind, int(forced))
        try:
            greq = await anyio.to_thread.run_sync(parse_generate, body, cfg, state.tokenizer)
        except ApiError as exc:
            state.bad_requests += 1
            return exc.response()
        except ContractError as exc:
            # http_server.py `generate_request`: the contract gate's own body.
            state.bad_requests += 1
            return Response(
                json.dumps({"error": str(exc)}).encode(), 400, media_type="application/json"
            )
        except GenerateValueError as exc:
            state.bad_requests += 1
            if body.get("stream") is True:
                # The ValueError surfaces inside the stream generator, after the 200.
                return self._stream_error(str(exc))
            error = {"error": {"message": str(exc)}}
            return Response(json.dumps(error).encode(), 400, media_type="application/json")

        runs = await anyio.to_thread.run_sync(self._prepare, greq.items)
        if greq.stream:
            state.streams += 1
            return StreamingResponse(
                self._gated_stream(runs, greq.is_single, received),
                media_type="text/event-stream",
            )
        if not await self._pass_gate(runs):
            return error_response("mock engine is shutting down", "InternalServerError", 503)
        state.flight(+len(runs))
        try:
            results = await asyncio.gather(*(self._finish(run) for run in runs))
        finally:
            state.flight(-len(runs))
            for run in runs:
                state.running.pop(run.item.rid, None)
        if any(r is None for r in results):
            return error_response("mock engine is shutting down", "InternalServerError", 503)
        outs: list[Any] = []
        splices: dict[str, list[Part]] = {}
        e2e = time.monotonic() - received
        for n, run in enumerate(runs):
            completion = results[n]
            assert completion is not None
            meta, sp = meta_info(
                run.item,
                completion,
                upto=completion.completion_tokens,
                finished=True,
                cached=run.cached,
                weight_version=state.weight_version,
                cfg=cfg,
                tokenizer=state.tokenizer,
                e2e_latency=e2e,
                sent_ts=time.time(),
            )
            if sp:
                # One placeholder per prompt, so batched R3 bodies splice in their own rows.
                (key,) = sp
                meta["routed_experts"] = f"{key}{n}"
                splices[f"{key}{n}"] = sp[key]
            outs.append(out_dict(run.item, completion.content, completion.ids, meta))
            state.tokens_generated += completion.completion_tokens
        payload: Any = outs[0] if greq.is_single else outs
        return PartsResponse(dumps_spliced(payload, splices))

    def _prepare(self, items: list[GenItem]) -> list[_InFlightPrompt]:
        """Generate every prompt's output (worker thread), and without the scheduler match
        and fill the prefix cache as the chat route does."""
        state = self.state
        gen = state.generator
        runs: list[_InFlightPrompt] = []
        for item in items:
            completion = gen.generate(
                item.prompt_ids,
                request_seed=item.seed,
                max_tokens=item.max_new_tokens,
                variant=item.lora or "",
                natural_tokens=item.max_new_tokens + 1 if item.ignore_eos else None,
            )
            completion = apply_stops(item, completion, state.tokenizer)
            abort = asyncio.Event()
            run = _InFlightPrompt(item, completion, abort)
            state.prompt_tokens += len(item.prompt_ids)
            ns = cache_namespace(item.extra_key, item.lora, item.cache_salt)
            limit = (
                item.logprob_start_len
                if item.return_logprob and item.logprob_start_len >= 0
                else None
            )
            if item.r3_error is not None:
                pass  # aborted by the scheduler before its prefill: nothing cached
            elif self.scheduler is not None:
                run.job = Job(item.prompt_ids, completion.ids, ns, abort, item.lora, limit)
            else:
                run.cached = state.prefix_cache.match(item.prompt_ids, ns, limit)
                state.prefix_cache.insert([*item.prompt_ids, *completion.ids[:-1]], ns)
                state.count_prompt(len(item.prompt_ids), run.cached, item.lora)
            runs.append(run)
        return runs

    async def _pass_gate(self, runs: list[_InFlightPrompt]) -> bool:
        """tokenizer_manager.py `generate_request`: a valid request waits while the engine is
        paused (or a weight update drains), then goes to the scheduler; registered in the
        same step as it passes, so a pause's abort_all cannot miss it. False: shutting down."""
        state = self.state
        if await state.pass_gate() == "closing":
            return False
        for run in runs:
            state.running[run.item.rid] = run.abort
        return True

    async def _gated_stream(
        self, runs: list[_InFlightPrompt], is_single: bool, received: float
    ) -> AsyncIterator[Part]:
        """http_server.py `serve_generate_request` returns its StreamingResponse before
        tokenizer_manager.py `generate_request` runs: a stream held by a pause has its 200
        and headers, and its first event after the continue."""
        if not await self._pass_gate(runs):
            return
        async for part in self._stream(runs, is_single, received):
            yield part

    def _submit(self, run: _InFlightPrompt) -> None:
        if self.scheduler is not None and run.job is not None:
            self.scheduler.submit(run.job)

    async def _wait(self, run: _InFlightPrompt, tokens: int, first: bool, step: int) -> str:
        """Until `tokens` output tokens exist: the scheduler's progress, or the chat
        route's sleeps (`step` tokens' delay, plus the ttft before the first output)."""
        if run.job is not None and self.scheduler is not None:
            status = await self.scheduler.wait(run.job, tokens)
            run.cached = run.job.cached
            return status
        cfg = self.state.config
        seconds = (cfg.ttft_ms / 1000) if first else 0.0
        return await interruptible_sleep(
            self.state, seconds + cfg.token_delay_ms * step / 1000, run.abort
        )

    async def _finish(self, run: _InFlightPrompt) -> Completion | None:
        self._submit(run)
        start = self.state.clock()
        total = run.completion.completion_tokens
        status = await self._wait(run, total, True, total)
        if status == "closing":
            return None
        if status == "abort":
            if run.job is not None:
                done = run.job.done
            else:
                cfg = self.state.config
                spent = (self.state.clock() - start) * 1000 - cfg.ttft_ms
                done = int(spent // cfg.token_delay_ms) if cfg.token_delay_ms > 0 else 0
            self.state.aborted += 1
            return self.state.generator.aborted(run.completion, max(0, min(done, total - 1)))
        return run.completion

    def _stream_error(self, message: str) -> Response:
        # http_server.py `stream_results`: the error as one event, then [DONE], in a 200.
        error = {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "code": 400,
                "retryable": False,
            }
        }

        async def events() -> AsyncIterator[bytes]:
            yield b"data: " + json.dumps(error).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def _item_events(
        self, run: _InFlightPrompt, index: int | None, received: float
    ) -> AsyncIterator[list[Part]]:
        """tokenizer_manager.py, non-incremental streaming: one chunk per engine step with
        the cumulative text, output_ids and meta_info; the first chunk carries
        response_sent_to_client_ts, the last the finish reason and e2e_latency."""
        state = self.state
        cfg = state.config
        item = run.item

        def tag(out: dict[str, Any]) -> dict[str, Any]:
            if index is not None:
                out["index"] = index  # _stream_batch_responses
            return out

        if item.r3_error is not None:
            meta = r3_abort_meta(item, state.weight_version)
            meta["e2e_latency"] = time.monotonic() - received
            meta["response_sent_to_client_ts"] = time.time()
            yield _sse(tag(out_dict(item, "", [], meta)))
            return
        self._submit(run)
        completion = run.completion
        pieces = await anyio.to_thread.run_sync(
            state.generator.stream_pieces, completion, cfg.stream_chunk_tokens
        )
        text = ""
        start = state.clock()
        for n, piece in enumerate(pieces):
            # As the chat stream: the ttft before the first step, a token delay per token of
            # every later step.
            step = piece.stop - piece.start if n else 0
            status = await self._wait(run, piece.stop, n == 0, step)
            if status == "closing":
                return
            final = piece.stop >= completion.completion_tokens
            upto = piece.stop
            if status == "abort":
                if run.job is not None:
                    done = run.job.done
                else:
                    spent = (state.clock() - start) * 1000 - cfg.ttft_ms
                    done = int(spent // cfg.token_delay_ms) if cfg.token_delay_ms > 0 else 0
                done = max(0, min(done, piece.start, completion.completion_tokens - 1))
                completion = state.generator.aborted(completion, done)
                state.aborted += 1
                final, upto, text = True, done, completion.content
            else:
                text += piece.content
            meta, splices = meta_info(
                item,
                completion,
                upto=upto,
                finished=final,
                cached=run.cached,
                weight_version=state.weight_version,
                cfg=cfg,
                tokenizer=state.tokenizer,
                e2e_latency=time.monotonic() - received,
                sent_ts=time.time() if n == 0 else None,
            )
            shown = completion.content if final else text
            yield _sse(tag(out_dict(item, shown, completion.ids[:upto], meta)), splices)
            if final:
                state.tokens_generated += upto
                return

    async def _stream(
        self, runs: list[_InFlightPrompt], is_single: bool, received: float
    ) -> AsyncIterator[Part]:
        state = self.state
        state.flight(+len(runs))
        try:
            if is_single:
                async for parts in self._item_events(runs[0], None, received):
                    for part in send_slices(parts):
                        yield part
            else:
                queue: asyncio.Queue[list[Part] | None] = asyncio.Queue()

                async def pump(run: _InFlightPrompt, index: int) -> None:
                    try:
                        async for parts in self._item_events(run, index, received):
                            await queue.put(parts)
                    finally:
                        await queue.put(None)

                tasks = [asyncio.create_task(pump(r, i)) for i, r in enumerate(runs)]
                left = len(tasks)
                try:
                    while left:
                        got = await queue.get()
                        if got is None:
                            left -= 1
                            continue
                        for part in send_slices(got):
                            yield part
                finally:
                    for t in tasks:
                        t.cancel()
            if not state.closing.is_set():
                yield b"data: [DONE]\n\n"
        finally:
            state.flight(-len(runs))
            for run in runs:
                state.running.pop(run.item.rid, None)
                if run.job is not None and not run.job.finished:
                    run.abort.set()  # the client went away: free the batch slot

    # ---- /flush_cache and /v1/loads ----

    def _idle(self) -> bool:
        if self.scheduler is not None:
            return not self.scheduler.running and not self.scheduler.waiting
        return self.state.in_flight == 0

    async def flush_cache(self, request: Request) -> Response:
        """http_server.py `flush_cache` + scheduler.py `flush_cache` + flush_wrapper.py:
        only an idle engine flushes; `?timeout=` waits for idleness that long."""
        raw = request.query_params.get("timeout", "0")
        try:
            timeout = float(raw)
        except ValueError:
            timeout = -1.0
        if not timeout >= 0:
            msg = "Input should be greater than or equal to 0"
            return validation_error(
                [{"type": "greater_than_equal", "loc": ("query", "timeout"), "msg": msg}]
            ).response()
        deadline = time.monotonic() + timeout
        while not self._idle():
            if timeout <= 0:
                return Response(FLUSH_FAILED, 400)
            if time.monotonic() >= deadline:
                return Response(FLUSH_TIMEOUT, 400)
            await asyncio.sleep(0.01)
        self.state.prefix_cache.flush()
        return Response(FLUSH_OK, 200)

    async def metrics(self, request: Request) -> Response:
        """`/metrics` as an engine started with `--enable-metrics` serves it
        (utils/common.py `add_prometheus_middleware`: prometheus_client's text format and
        content type), a few families of observability/metrics_collector.py with their
        names, help texts and labels (the scheduler's `model_name`, `engine_type`,
        `tp_rank`, `pp_rank`, `moe_ep_rank`; the tokenizer's `model_name`, `engine_type`,
        plus `is_streaming` on its token counters). The mock serves it always."""
        state, sch = self.state, self.scheduler
        running = len(sch.running) if sch is not None else state.in_flight
        waiting = len(sch.waiting) if sch is not None else 0
        prompt_total = state.cached_tokens + state.prefilled_tokens
        hit_rate = state.cached_tokens / prompt_total if prompt_total else 0.0
        model = _label(state.config.model_name)
        scheduler = (
            f'model_name="{model}",engine_type="unified",tp_rank="0",pp_rank="0",moe_ep_rank="0"'
        )
        tokenizer = f'model_name="{model}",engine_type="unified",is_streaming="false"'
        families = [
            ("sglang:num_running_reqs", "gauge", METRIC_HELP[0], scheduler, float(running)),
            ("sglang:num_queue_reqs", "gauge", METRIC_HELP[1], scheduler, float(waiting)),
            ("sglang:cache_hit_rate", "gauge", METRIC_HELP[2], scheduler, hit_rate),
            ("sglang:prompt_tokens_total", "counter", METRIC_HELP[3], tokenizer, prompt_total),
        ]
        lines: list[str] = []
        for name, kind, text, labels, value in families:
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
            lines.append(f"{name}{{{labels}}} {float(value)!r}")
        body = ("\n".join(lines) + "\n").encode()
        return Response(body, media_type=None, headers={"content-type": METRICS_CONTENT_TYPE})

    async def loads(self, request: Request) -> Response:
        """v1_loads.py `get_loads` with one DP rank: LoadSnapshot.to_dict's core keys in
        its field order (load_snapshot.py), plus the queues section unless `include`
        leaves it out; the mock has no memory, spec, LoRA-pool or disagg figures."""
        include_raw = request.query_params.get("include")
        include = {s.strip() for s in include_raw.split(",")} if include_raw else None
        valid = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}
        if include is not None and not include <= valid:
            # LoadSnapshot.to_dict raises outside the route's try: a 500.
            return Response("Internal Server Error", 500, media_type="text/plain")
        dp_rank = request.query_params.get("dp_rank")
        state = self.state
        sch = self.scheduler
        cfg = state.config
        if sch is not None:
            running, waiting = len(sch.running), len(sch.waiting)
            used = sch.used_tokens()
            total = used + sch.waiting_tokens()
            waiting_uncached = sch.waiting_uncached_tokens()
            prefill_uncached, prefill_busy = (
                sch.total_prefill_uncached_tokens,
                sch.total_prefill_busy_us,
            )
            max_running = cfg.max_running_requests
        else:
            running, waiting, used, total, waiting_uncached = state.in_flight, 0, 0, 0, 0
            prefill_uncached, prefill_busy, max_running = state.prefilled_tokens, 0, 0
            if state.retracted:
                # scheduler.py `pause_generation` (retract): back in the waiting queue.
                running, waiting = 0, state.in_flight
        capacity = cfg.prefix_cache_tokens
        prompt_total = state.cached_tokens + state.prefilled_tokens
        load: dict[str, Any] = {
            "timestamp": time.time(),
            "dp_rank": 0,
            "num_running_reqs": running,
            "num_waiting_reqs": waiting,
            "num_waiting_uncached_tokens": waiting_uncached,
            "num_used_tokens": used,
            "num_total_tokens": total,
            "num_active_tokens": total,
            "num_prealloc_ready_tokens": 0,
            "max_total_num_tokens": capacity,
            "max_running_requests": max_running,
            "token_usage": round(used / capacity, 4) if capacity else 0.0,
            "gen_throughput": 0.0,
            "cache_hit_rate": round(state.cached_tokens / prompt_total, 4) if prompt_total else 0.0,
            "utilization": 0.0,
            "total_prefill_uncached_tokens": prefill_uncached,
            "total_prefill_busy_us": prefill_busy,
            "decode_moments": None,
        }
        every = include is None or "all" in include
        if every or "disagg" in include:  # type: ignore[operator]
            load["disaggregation"] = {
                "mode": "null",
                "prefill_bootstrap_queue_reqs": 0,
                "prefill_inflight_queue_reqs": 0,
                "decode_prealloc_queue_reqs": 0,
                "decode_transfer_queue_reqs": 0,
                "decode_retracted_queue_reqs": 0,
                "kv_transfer_speed_gb_s": 0.0,
                "kv_transfer_latency_ms": 0.0,
            }
        if every or "queues" in include:  # type: ignore[operator]
            load["queues"] = {
                "waiting": waiting,
                "grammar": 0,
                "paused": 0,
                "retracted": 0,
                "prealloc_ready": 0,
            }
        loads = [load]
        if dp_rank is not None and dp_rank.lstrip("-").isdigit() and int(dp_rank) != 0:
            loads = []  # tokenizer_control_mixin.py `get_loads`: out-of-range rank -> []
        body = {
            "timestamp": datetime.now(UTC).isoformat(),
            "version": self.state.config.sglang_version,
            "accelerator": None,
            "num_accelerators": 1,
            "loads": loads,
        }
        return Response(json.dumps(body).encode(), media_type="application/json")


def _label(value: str) -> str:
    """A Prometheus label value, escaped as the text format requires."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

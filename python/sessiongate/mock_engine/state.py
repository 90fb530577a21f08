"""The mock engine's mutable state: counters, captures, running requests and fault queues.

One `EngineState` per app, shared by the chat route, the stream and the admin routes; the
in-process callers (relay tests, benches) build one by hand to call `build_reply`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from sessiongate.mock_engine.config import MockEngineConfig
from sessiongate.mock_engine.generate import CompletionGenerator
from sessiongate.mock_engine.prefix_cache import PrefixCache
from sessiongate.mock_engine.tokens import TokenizerLike

RECENT_REQUESTS = 256


@dataclass(slots=True)
class EngineState:
    """One engine's live state: what it serves, its counters (`/mock/stats`), its
    captures (`/mock/requests`) and the hooks that abort running requests."""

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
    # Benchmark counters: prompt tokens found in the prefix cache, prompt tokens prefilled
    # (not cached), requests per LoRA adapter ("" = the base model).
    cached_tokens: int = 0
    prefilled_tokens: int = 0
    adapter_requests: dict[str, int] = field(default_factory=dict)
    # Time-integral of in_flight since `started`, for its time average.
    started: float = field(default_factory=time.monotonic)
    _flight_area: float = 0.0
    _flight_at: float = field(default_factory=time.monotonic)

    def flight(self, delta: int) -> None:
        """Change `in_flight` by `delta`, keeping its time integral."""
        now = time.monotonic()
        self._flight_area += self.in_flight * (now - self._flight_at)
        self._flight_at = now
        self.in_flight += delta

    def count_prompt(self, prompt_tokens: int, cached: int, adapter: str | None) -> None:
        """One request's prompt as it reached the engine."""
        self.cached_tokens += cached
        self.prefilled_tokens += prompt_tokens - cached
        key = adapter or ""
        self.adapter_requests[key] = self.adapter_requests.get(key, 0) + 1

    def in_flight_avg(self) -> float:
        now = time.monotonic()
        area = self._flight_area + self.in_flight * (now - self._flight_at)
        return area / (now - self.started) if now > self.started else 0.0

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


async def interruptible_sleep(
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

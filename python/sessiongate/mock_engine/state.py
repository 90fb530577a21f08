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
# io_struct.py PauseGenerationReqInput.mode.
PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[PauseMode, ...] = ("abort", "retract", "in_place")


def _set_event() -> asyncio.Event:
    event = asyncio.Event()
    event.set()
    return event


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
    # The model a weight update loaded (tokenizer_manager.py `_update_model_path_info` moves
    # model_path and served_model_name together); "" = the configured model name.
    model_path: str = ""
    # POST /pause_generation .. /continue_generation (tokenizer_manager.py `is_pause`).
    paused: bool = False
    pause_mode: PauseMode | None = None
    # The scheduler stopped stepping (a retract or in_place pause; an abort pause leaves it
    # running), and whether its running requests went back to the waiting queue (retract).
    halted: bool = False
    retracted: bool = False
    # Weight updates from disk waiting for the running requests to finish (the writer side
    # of tokenizer_manager.py `model_update_lock`): new requests wait meanwhile.
    draining: int = 0
    # Set while new requests may go to the scheduler (not paused, no update draining).
    gate: asyncio.Event = field(default_factory=_set_event)
    # Set while the scheduler makes progress; `stalled` is its complement, so a sleep can
    # wait for either edge.
    progress: asyncio.Event = field(default_factory=_set_event)
    stalled: asyncio.Event = field(default_factory=asyncio.Event)
    # Requests waiting at the gate now, and per route those that arrived while paused (a
    # router test's proof that nothing was sent to a paused engine).
    held: int = 0
    arrived_while_paused: dict[str, int] = field(default_factory=dict)
    pauses: int = 0
    weight_updates: int = 0
    _paused_total: float = 0.0
    _halted_at: float = 0.0

    @property
    def served_model_name(self) -> str:
        return self.model_path or self.config.model_name

    def pause(self, mode: PauseMode) -> None:
        """tokenizer_manager.py `pause_generation`: new requests wait at the gate; a retract
        or in_place pause also stops the scheduler (scheduler.py `pause_generation`)."""
        self.paused = True
        self.pause_mode = mode
        self.pauses += 1
        if mode != "abort" and not self.halted:
            self.halted = True
            self._halted_at = time.monotonic()
            self.progress.clear()
            self.stalled.set()
        if mode == "retract":
            self.retracted = True
        self._refresh_gate()

    def resume(self) -> None:
        """tokenizer_manager.py `continue_generation`: the scheduler steps again and the
        requests waiting at the gate go on (a no-op when not paused)."""
        if self.halted:
            self._paused_total += time.monotonic() - self._halted_at
        self.paused = self.halted = self.retracted = False
        self.pause_mode = None
        self.stalled.clear()
        self.progress.set()
        self._refresh_gate()

    def drain(self, delta: int) -> None:
        """A weight update starts (+1) or ends (-1) waiting for the running requests."""
        self.draining += delta
        self._refresh_gate()

    def _refresh_gate(self) -> None:
        if self.paused or self.draining:
            self.gate.clear()
        else:
            self.gate.set()

    def abort_all(self) -> None:
        """Abort every running request (tokenizer_manager.py `abort_request(abort_all=True)`:
        the scheduler's requests; those waiting at the gate were never sent)."""
        for event in self.running.values():
            event.set()

    def note_arrival(self, route: str) -> None:
        """Count a request to a generation route that arrived while paused."""
        if self.paused:
            self.arrived_while_paused[route] = self.arrived_while_paused.get(route, 0) + 1

    async def pass_gate(self) -> Literal["ok", "closing"]:
        """Wait while paused or a weight update drains (tokenizer_manager.py
        `generate_request` waits on is_pause_cond, then takes the model_update_lock reader
        side); returns at once, without yielding, when the gate is open, so the caller can
        register its request before a pause can slip in."""
        if self.gate.is_set():
            return "ok"
        self.held += 1
        try:
            while not self.gate.is_set():
                if await first_set(self.closing, self.gate) is self.closing:
                    return "closing"
        finally:
            self.held -= 1
        return "ok"

    def clock(self) -> float:
        """time.monotonic() with the halted time taken out: what a request's progress is
        measured by, since a halted scheduler generates nothing."""
        halted = time.monotonic() - self._halted_at if self.halted else 0.0
        return time.monotonic() - self._paused_total - halted

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

    def pause_stats(self) -> dict[str, object]:
        """The pause state /mock/stats reports."""
        return {
            "paused": self.paused,
            "pause_mode": self.pause_mode,
            "held": self.held,
            "arrived_while_paused": sum(self.arrived_while_paused.values()),
            "arrived_while_paused_by_route": dict(self.arrived_while_paused),
            "pauses": self.pauses,
            "weight_updates": self.weight_updates,
        }


async def first_set(*events: asyncio.Event, timeout: float | None = None) -> asyncio.Event | None:
    """The first of `events` to be set (one already set wins at once); None on timeout."""
    for event in events:
        if event.is_set():
            return event
    waiters = {asyncio.ensure_future(e.wait()): e for e in events}
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
    for event in events:
        if event.is_set():
            return event
    return None


async def interruptible_sleep(
    state: EngineState, seconds: float, abort: asyncio.Event | None = None
) -> Literal["ok", "closing", "abort"]:
    """Sleep `seconds` of generation time, cut short by shutdown ("closing") or an abort of
    this request. While the scheduler is halted (a retract or in_place pause) the time
    stops: the request makes no progress and goes on where it was after the continue."""
    left = seconds
    while True:
        if state.closing.is_set():
            return "closing"
        if abort is not None and abort.is_set():
            return "abort"
        cut = [state.closing] if abort is None else [state.closing, abort]
        if state.stalled.is_set():
            await first_set(*cut, state.progress)
            continue
        if left <= 0:
            return "ok"
        start = time.monotonic()
        if await first_set(*cut, state.stalled, timeout=left) is None:
            return "ok"
        left -= time.monotonic() - start

"""A step scheduler, so an engine with more work is observably slower, as a real one is.

Without it every request sleeps its own `--ttft-ms` and `--token-delay-ms`, however many
others run: fine for contract tests, useless for comparing routing policies, where what
matters is that a busy engine answers later and that a prefix-cache hit saves prefill time.

With `--step-scheduler` the engine runs one loop, like SGLang's scheduler
(managers/scheduler.py `event_loop_normal`): requests wait in a FIFO queue; a step first
admits waiting requests while the running batch has room (`--max-running-requests`),
matches each prompt against the prefix cache at that moment (`cached_tokens`), within a
budget of `--max-prefill-tokens` uncached tokens per step (SGLang's PrefillAdder; the first
request always goes in), and runs one prefill step costing `--prefill-us-per-token` per
uncached prompt token; the prefill gives each admitted request its first token and inserts
its prompt into the cache (the radix cache is filled when a prefill completes). With
nobody to admit, a decode step of `--decode-step-ms` gives every running request one more
token. A finished request leaves its prompt and output (all but the last token) in the
cache. `--speed` divides every step's time, so `--speed 0.5` is an engine twice as slow.

A retract or in_place `/pause_generation` halts the loop (scheduler.py `event_loop_normal`
skips batches while `_engine_paused`); a retract pause first moves the running requests back
to the head of the waiting queue (scheduler.py `pause_generation`), to be prefilled again
(prompt only: the mock keeps their output so far) after `/continue_generation`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from sessiongate.mock_engine.config import MockEngineConfig
from sessiongate.mock_engine.prefix_cache import PrefixCache

WaitStatus = Literal["ok", "abort", "closing"]


@dataclass(eq=False, slots=True)
class Job:
    """One request inside the scheduler: what it costs and how far it got."""

    prompt: Sequence[int]
    output: Sequence[int]  # the ids it will produce (the generator decided them up front)
    namespace: str  # prefix-cache namespace (extra_key + LoRA adapter)
    abort: asyncio.Event
    adapter: str | None = None
    limit: int | None = None  # longest usable cached prefix (logprob_start_len)
    cached: int = 0
    done: int = 0  # output tokens produced so far
    admitted: bool = False
    finished: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def total(self) -> int:
        return len(self.output)


class StepScheduler:
    """The running batch, the waiting queue and the loop that steps them."""

    def __init__(
        self,
        config: MockEngineConfig,
        cache: PrefixCache,
        closing: asyncio.Event,
        on_admit: Callable[[Job], None] | None = None,
        progress: asyncio.Event | None = None,
    ) -> None:
        self.config = config
        self.cache = cache
        self.closing = closing
        self.on_admit = on_admit
        # Set while the engine is not halted by a pause (None: never halted).
        self.progress = progress
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # Counters SGLang's /v1/loads reports (LoadSnapshot).
        self.total_prefill_uncached_tokens = 0
        self.total_prefill_busy_us = 0
        # Every step's modelled time, prefill and decode: the engine's busy time, which
        # a routing bench compares without the host's own CPU time in it.
        self.total_busy_us = 0
        self.steps = 0

    def submit(self, job: Job) -> None:
        """Queue `job`; the loop starts with the first job (it needs the running loop)."""
        self.waiting.append(job)
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def wait(self, job: Job, tokens: int) -> WaitStatus:
        """Until `job` has `tokens` output tokens (or finished), is aborted, or the engine
        shuts down. `tokens` 0 waits for the prefill-only request to finish: its prefill
        (schedule_batch.py `Req.is_prefill_only`: `max_new_tokens == 0`)."""
        while not (job.finished or (tokens > 0 and job.done >= tokens)):
            if self.closing.is_set():
                return "closing"
            if job.abort.is_set():
                return "abort"
            job.changed.clear()
            waiters = [
                asyncio.ensure_future(job.changed.wait()),
                asyncio.ensure_future(job.abort.wait()),
                asyncio.ensure_future(self.closing.wait()),
            ]
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waiters:
                    w.cancel()
        return "ok"

    def retract(self) -> None:
        """Move the running requests back to the head of the waiting queue, in order."""
        back = [job for job in self.running if not job.finished]
        self.running = []
        self.waiting.extendleft(reversed(back))

    async def _until_progress(self) -> None:
        """While halted by a pause: wait for the continue (or shutdown)."""
        progress = self.progress
        while progress is not None and not progress.is_set() and not self.closing.is_set():
            waiters = [
                asyncio.ensure_future(progress.wait()),
                asyncio.ensure_future(self.closing.wait()),
            ]
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waiters:
                    w.cancel()

    def used_tokens(self) -> int:
        """KV tokens the running batch holds (prompt and output so far)."""
        return sum(len(j.prompt) + j.done for j in self.running)

    def waiting_tokens(self) -> int:
        return sum(len(j.prompt) for j in self.waiting)

    def waiting_uncached_tokens(self) -> int:
        return sum(
            len(j.prompt) - self.cache.match(j.prompt, j.namespace, j.limit) for j in self.waiting
        )

    async def _sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)  # a free step still lets the requests see their tokens
        else:
            try:
                await asyncio.wait_for(self.closing.wait(), timeout=seconds)
            except TimeoutError:
                pass

    def _finish(self, job: Job) -> None:
        job.finished = True
        if job in self.running:
            self.running.remove(job)
        # The radix cache keeps what had KV computed: the prompt and all but the last token.
        self.cache.insert([*job.prompt, *job.output[: max(0, job.done - 1)]], job.namespace)
        job.changed.set()

    async def _loop(self) -> None:
        cfg = self.config
        while not self.closing.is_set():
            for job in [j for j in self.running if j.abort.is_set()]:
                self._finish(job)
            if self.progress is not None and not self.progress.is_set():
                await self._until_progress()
                continue
            if not self.waiting and not self.running:
                self._wake.clear()
                await asyncio.wait(
                    [
                        asyncio.ensure_future(self._wake.wait()),
                        asyncio.ensure_future(self.closing.wait()),
                    ],
                    return_when=asyncio.FIRST_COMPLETED,
                )
                continue
            admitted: list[Job] = []
            budget = cfg.max_prefill_tokens
            while self.waiting and len(self.running) + len(admitted) < cfg.max_running_requests:
                job = self.waiting[0]
                if job.abort.is_set():
                    self.waiting.popleft()
                    job.finished = True
                    job.changed.set()
                    continue
                # Matched at schedule time, against what earlier prefills left: requests
                # admitted in one step do not see each other's prompts (SGLang's default
                # fcfs schedule does no in-batch prefix matching).
                cached = self.cache.match(job.prompt, job.namespace, job.limit)
                uncached = len(job.prompt) - cached
                if admitted and uncached > budget:
                    break  # the next step takes it, maybe with a hit by then
                budget -= uncached
                self.waiting.popleft()
                job.cached = cached
                if self.on_admit is not None and not job.admitted:
                    self.on_admit(job)  # once: a retracted request is not a new one
                job.admitted = True
                admitted.append(job)
            self.steps += 1
            if admitted:
                uncached = sum(len(j.prompt) - j.cached for j in admitted)
                busy_us = uncached * cfg.prefill_us_per_token / cfg.speed
                self.total_prefill_uncached_tokens += uncached
                self.total_prefill_busy_us += int(busy_us)
                self.total_busy_us += int(busy_us)
                await self._sleep(busy_us / 1e6)
                for job in admitted:
                    # The prefill is done: its prompt is in the cache, its first token out.
                    self.cache.insert(job.prompt, job.namespace)
                    self.running.append(job)
                    # A retracted request keeps the tokens it had.
                    job.done = max(job.done, min(1, job.total))
                    job.changed.set()
                    if job.done >= job.total:
                        self._finish(job)
                continue
            decode_us = cfg.decode_step_ms / cfg.speed * 1000
            self.total_busy_us += int(decode_us)
            await self._sleep(decode_us / 1e6)
            for job in list(self.running):
                if job.abort.is_set():
                    self._finish(job)
                    continue
                job.done += 1
                job.changed.set()
                if job.done >= job.total:
                    self._finish(job)

"""When session families start: concurrency cap, Poisson arrivals, count or duration, warm-up.

- `concurrency`: at most this many trees in flight (children do not count: they belong
  to their tree). A closed loop: a tree starts when one finishes.
- `request_rate`: trees arrive as a Poisson process of this rate (exponential gaps from a
  seeded RNG, so the schedule repeats). With a concurrency cap too, an arrival that finds
  no free slot waits for one.
- `sessions` / `duration_s`: stop starting trees after this many, or this many seconds
  after the measured phase began (trees in flight then finish; both given: first wins).
- Warm-up: `warmup_sessions` trees run first as their own phase (the measured phase starts
  when they are all done); `warmup_s` instead marks every request that starts in the first
  seconds as warm-up (the run is not split). Warm-up requests appear in `--raw` with
  `"warmup": true` and in no figure.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

# A root spec: a `SessionSpec` (sub-agent trees) or a `TreeSessionSpec` (tree sessions);
# pacing only hands it to the driver.
Spec = TypeVar("Spec")


@dataclass(frozen=True, slots=True)
class Pacing:
    sessions: int | None = None
    concurrency: int | None = None
    request_rate: float | None = None
    duration_s: float | None = None
    warmup_sessions: int = 0
    warmup_s: float = 0.0
    seed: int = 0

    def check(self) -> None:
        if self.sessions is None and self.duration_s is None:
            raise ValueError("give --sessions or --duration")
        if self.sessions is not None and self.sessions < 1:
            raise ValueError("--sessions must be >= 1")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("--concurrency must be >= 1")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError("--request-rate must be > 0")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError("--duration must be > 0")
        if self.warmup_sessions < 0 or self.warmup_s < 0:
            raise ValueError("--warmup must be >= 0")


async def _launch(
    specs: Iterator[Spec],
    run_tree: Callable[[Spec, bool], Coroutine[Any, Any, None]],
    pacing: Pacing,
    *,
    warmup: bool,
    deadline: float | None,
) -> None:
    loop = asyncio.get_running_loop()
    slots = asyncio.Semaphore(pacing.concurrency) if pacing.concurrency else None
    arrivals = random.Random(f"sessiongate-bench-arrivals|{pacing.seed}|{warmup}")
    tasks: set[asyncio.Task[None]] = set()
    next_arrival = loop.time()

    def finished(task: asyncio.Task[None]) -> None:
        tasks.discard(task)
        if slots is not None:
            slots.release()

    try:
        for spec in specs:
            if deadline is not None and loop.time() >= deadline:
                break
            if pacing.request_rate:
                next_arrival += arrivals.expovariate(pacing.request_rate)
                if deadline is not None and next_arrival >= deadline:
                    break
                await asyncio.sleep(max(0.0, next_arrival - loop.time()))
            if slots is not None:
                await slots.acquire()
                if deadline is not None and loop.time() >= deadline:
                    slots.release()
                    break
            task = asyncio.create_task(run_tree(spec, warmup))
            tasks.add(task)
            task.add_done_callback(finished)
        # Nothing starts after the loop, so one gather covers every tree still running.
        await asyncio.gather(*list(tasks))
    except asyncio.CancelledError:
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*list(tasks), return_exceptions=True)
        raise


async def drive(
    workload: Iterable[Spec],
    run_tree: Callable[[Spec, bool], Coroutine[Any, Any, None]],
    pacing: Pacing,
    *,
    on_measured: Callable[[], None] | None = None,
) -> None:
    """Start every tree of the run as `pacing` says; return when all have finished."""
    pacing.check()
    specs = iter(workload)
    if pacing.warmup_sessions:
        warm = itertools.islice(specs, pacing.warmup_sessions)
        await _launch(warm, run_tree, pacing, warmup=True, deadline=None)
    if on_measured is not None:
        on_measured()
    loop = asyncio.get_running_loop()
    deadline = None
    if pacing.duration_s is not None:
        deadline = loop.time() + pacing.warmup_s + pacing.duration_s
    measured = specs if pacing.sessions is None else itertools.islice(specs, pacing.sessions)
    await _launch(measured, run_tree, pacing, warmup=False, deadline=deadline)

"""Requests held while their engine may not take new work: paused (through the RL control
plane, or seen paused by the prober) or, under `--newest-weights-only`, at an older weight
version than the newest.

The engine registry decides which engines are held and sends the set with the engine set
(`EnginePool.set_urls(urls, held)`); each pool of the process holds its own requests here.
A held engine is no candidate for a new pick (the policy sees it unavailable), but a
session family pinned to it stays pinned: its turns wait for it rather than re-prefill their
whole history on another engine. When every candidate is held, a stateless request waits
too. Waiting is bounded: `--pause-queue-size` requests per process (one more is a 503 at
once) and `--pause-wait-secs` each (then a 503); a change of the held set wakes every
waiter, which then picks again, so requests flow the moment one engine continues.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from sessiongate.config.rl import DEFAULT_PAUSE_QUEUE, DEFAULT_PAUSE_WAIT_S
from sessiongate.errors import Unavailable


class HoldGate:
    """The held engines of one pool, and the requests waiting for them."""

    def __init__(
        self, queue_size: int = DEFAULT_PAUSE_QUEUE, wait_secs: float = DEFAULT_PAUSE_WAIT_S
    ) -> None:
        self.queue_size = queue_size
        self.wait_secs = wait_secs
        self.held: frozenset[str] = frozenset()
        self.waiting = 0
        # Requests that waited and were then sent, and those answered 503 (queue full or
        # waited too long): /health's figures for the pool.
        self.released = 0
        self.refused = 0
        self._changed = asyncio.Event()

    def set_held(self, urls: Iterable[str]) -> None:
        """The held set changed: every waiter looks again."""
        held = frozenset(u.rstrip("/") for u in urls)
        if held == self.held:
            return
        self.held = held
        self._changed.set()
        self._changed = asyncio.Event()

    def is_held(self, url: str) -> bool:
        return url in self.held

    async def route(self, pick: Callable[[], int], url_of: Callable[[int], str]) -> int:
        """`pick()`'s engine once it is not held: picked again after each change of the held
        set (a stateless request may then go to the engine that continued first; a pinned
        family's pick stays its engine). Unavailable (503) when the queue is full or the
        wait is over."""
        index = pick()
        if not self.held or url_of(index) not in self.held:
            return index
        if self.waiting >= self.queue_size:
            self.refused += 1
            raise Unavailable(
                f"engine {url_of(index)} is paused and {self.waiting} requests already wait "
                f"for paused engines in this process (--pause-queue-size {self.queue_size})"
            )
        self.waiting += 1
        try:
            async with asyncio.timeout(self.wait_secs):
                while url_of(index) in self.held:
                    await self._changed.wait()
                    index = pick()
        except TimeoutError:
            self.refused += 1
            raise Unavailable(
                f"engine {url_of(index)} stayed paused for {self.wait_secs:g} s (--pause-wait-secs)"
            ) from None
        finally:
            self.waiting -= 1
        self.released += 1
        return index

    def status(self) -> dict[str, object]:
        return {
            "held": sorted(self.held),
            "waiting": self.waiting,
            "released": self.released,
            "refused": self.refused,
        }

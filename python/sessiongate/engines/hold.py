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

A request picked just before its engine was held may not have been written to the engine
yet: `settle` waits until every such request is written (`sending` / `sent`, called from the
engine client once the request's bytes are out), so the pause sent after it never finds a
request of this gateway arriving behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable, Iterable

from sessiongate.config.rl import DEFAULT_PAUSE_QUEUE, DEFAULT_PAUSE_WAIT_S
from sessiongate.errors import Unavailable

# How long a change of the held set waits for requests picked before it to be written: a
# write takes microseconds, a connect to a slow engine up to its connect timeout.
HOLD_SETTLE_S = 5.0
# The compiled front's relay has no such count: requests it picked just before it stopped
# relaying are written within microseconds; this covers them.
FRONT_SETTLE_S = 0.02


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
        # Requests picked for each engine and not yet written to it.
        self._unsent: Counter[str] = Counter()
        self._all_sent = asyncio.Event()

    def sending(self, url: str) -> Callable[[], None]:
        """A request to `url` is about to be sent: the returned function says it was
        written (or will never be); calling it again does nothing."""
        self._unsent[url] += 1
        done = False

        def sent() -> None:
            nonlocal done
            if done:
                return
            done = True
            self._unsent[url] -= 1
            if self._unsent[url] <= 0:
                del self._unsent[url]
                if not any(u in self.held for u in self._unsent):
                    self._all_sent.set()

        return sent

    async def settle(self, timeout: float) -> None:
        """Wait (up to `timeout`) until no request picked for a held engine is unwritten."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while any(u in self.held for u in self._unsent):
                    self._all_sent = asyncio.Event()
                    await self._all_sent.wait()

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

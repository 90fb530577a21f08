"""Giving freed records' memory back to the OS, in batches and in quiet spells.

A part of the session core of its own because three others free records (a closed session,
a rollback, a spill to disk) and one thing (any request) postpones the trim: each of them
says so here, and only this class starts and owns the trim tasks (process/memory.py has the
policy).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from sessiongate.process.memory import (
    FreedMemoryTrimmer,
    prefault_free_memory,
    release_free_memory,
)
from sessiongate.session.limit_options import memory_bytes
from sessiongate.session.settings import SessionSettings

logger = logging.getLogger(__name__)

# Memory touched at start is at most this fraction of the machine's (or cgroup's), per process.
PREFAULT_SHARE = 16


class FreedMemory:
    """The core's trims of freed memory: counts what was freed, trims once enough was and
    the worker is quiet, and cancels a waiting trim at shutdown."""

    def __init__(
        self, trimmer: FreedMemoryTrimmer | None = None, *, keep: int = 0, prefault: int = 0
    ) -> None:
        self.trimmer = trimmer or FreedMemoryTrimmer()
        # Bytes of free memory each trim leaves mapped (--warm-records-bytes).
        self.keep = keep
        # Bytes to touch once at start, so the first sessions' records land warm too.
        self.prefault = prefault
        self.prefaulted: threading.Thread | None = None
        # Trims under way; a reference until done, as the loop holds tasks only weakly.
        self.tasks: set[asyncio.Future[None]] = set()

    @classmethod
    def for_settings(cls, settings: SessionSettings) -> FreedMemory:
        """Keeps --warm-records-bytes across quiet spells; with R3 also touches that much at
        start (at most --max-records-bytes, and a sixteenth of the machine's or its cgroup's
        memory: workers touch theirs each, so a small container with many workers is not
        filled at start), since only R3 records (20+ MiB a turn) pay for cold memory, and a
        gateway without them would hold the memory for nothing."""
        keep = settings.warm_records_bytes
        prefault = min(keep, memory_bytes() // PREFAULT_SHARE) if settings.r3 else 0
        if settings.max_records_bytes > 0:
            prefault = min(prefault, settings.max_records_bytes)
        return cls(keep=keep, prefault=prefault)

    def start(self) -> None:
        """Touch `prefault` bytes in a thread of its own, once (idempotent): about 0.55 s of
        CPU per GiB, where the first sessions' R3 turns would otherwise pay about 45 ms more
        each (docs/performance.md, "The cold first session")."""
        if self.prefault <= 0 or self.prefaulted is not None:
            return
        self.prefaulted = threading.Thread(target=self._prefault, name="sg-prefault", daemon=True)
        self.prefaulted.start()

    def _prefault(self) -> None:
        started = time.monotonic()
        touched = prefault_free_memory(self.prefault)
        if touched:
            logger.info(
                "records memory: %d MiB touched in %.2f s",
                touched >> 20,
                time.monotonic() - started,
            )

    def active(self) -> None:
        """A request arrived or a turn ended: memory is in use, postpone a due trim."""
        self.trimmer.active()

    def freed(self, nbytes: int, *, idle: bool = False) -> bool:
        """`nbytes` of records were freed (`idle`: nothing is stored any more); starts a
        trim when one is due, and says whether it did."""
        if not self.trimmer.freed(nbytes, idle=idle):
            return False
        task = asyncio.ensure_future(self._trim())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return True

    async def _trim(self) -> None:
        try:
            # Not while requests keep coming: their turns would reuse these pages warm.
            while (delay := self.trimmer.wait()) > 0:
                await asyncio.sleep(delay)
            await asyncio.to_thread(release_free_memory, self.keep)
        finally:
            self.trimmer.done()

    async def aclose(self) -> None:
        """A trim still waiting for a quiet spell is moot once the process is ending."""
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

"""Giving freed records' memory back to the OS, in batches and in quiet spells.

A part of the session core of its own because three others free records (a closed session,
a rollback, a spill to disk) and one thing (any request) postpones the trim: each of them
says so here, and only this class starts and owns the trim tasks (process/memory.py has the
policy).
"""

from __future__ import annotations

import asyncio

from sessiongate.process.memory import FreedMemoryTrimmer, release_free_memory


class FreedMemory:
    """The core's trims of freed memory: counts what was freed, trims once enough was and
    the worker is quiet, and cancels a waiting trim at shutdown."""

    def __init__(self, trimmer: FreedMemoryTrimmer | None = None, *, keep: int = 0) -> None:
        self.trimmer = trimmer or FreedMemoryTrimmer()
        # Bytes of free memory each trim leaves mapped (--warm-records-bytes).
        self.keep = keep
        # Trims under way; a reference until done, as the loop holds tasks only weakly.
        self.tasks: set[asyncio.Future[None]] = set()

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

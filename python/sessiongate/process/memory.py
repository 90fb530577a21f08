"""Give freed memory back to the operating system.

glibc keeps freed heap memory for reuse, and its mmap threshold grows with the largest block
freed (up to 32 MiB), so after the first large reply most records live in the heap rather
than in their own mappings. That reuse is what keeps R3 turns fast (fresh pages cost several
times a warm reuse on these VMs, docs/performance.md), but it also means a worker's RSS stays
at its high-water mark after every session is deleted (measured: 114 MiB -> 2.0 GiB after a
2-minute R3 soak whose sessions were all deleted). `malloc_trim(0)` returns the free pages
inside the heap, keeping the allocator's warm-reuse behaviour between trims.

A trim waits for the worker to go quiet: trimming between two sessions of a running load
hands back exactly the pages the next session's turns would have reused.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


def _load_libc_function(name: str, argtypes: list[Any]) -> Callable[..., int] | None:
    library = ctypes.util.find_library("c")
    if library is None:
        return None
    try:
        function = getattr(ctypes.CDLL(library), name)
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return None
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function  # type: ignore[no-any-return]


_MALLOC_TRIM = _load_libc_function("malloc_trim", [ctypes.c_size_t])


def release_free_memory() -> bool:
    """Return the allocator's free pages to the OS; False where that is not available.
    Takes milliseconds on a large heap: call it off the event loop."""
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True


class FreedMemoryTrimmer:
    """Counts bytes freed by closed sessions and trims once `threshold` bytes accumulated, or
    when the last session is gone, one trim at a time (a burst of deletes costs a few trims,
    not thousands). A trim that is due still waits until no request has come for `quiet`
    seconds (`wait()`), or until it has waited `max_delay` seconds."""

    def __init__(
        self,
        threshold: int = 64 << 20,
        *,
        quiet: float = 10.0,
        max_delay: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.threshold = threshold
        self.quiet = quiet
        self.max_delay = max_delay
        self.clock = clock
        self.pending = 0
        self.trims = 0
        self.running = False
        self.last_active = float("-inf")
        self.due_since = 0.0

    def active(self) -> None:
        """A request arrived or a turn ended: memory is in use, postpone a due trim."""
        self.last_active = self.clock()

    def freed(self, nbytes: int, *, idle: bool = False) -> bool:
        """Record `nbytes` freed (`idle`: nothing is stored any more); True when a trim
        should be started now (it then waits for `wait()` to say 0)."""
        self.pending += max(0, nbytes)
        enough = self.pending >= self.threshold or (idle and self.pending > 0)
        if self.running or not enough or _MALLOC_TRIM is None:
            return False
        self.running = True
        self.pending = 0
        self.due_since = self.clock()
        return True

    def wait(self) -> float:
        """Seconds the started trim should still wait: 0 once the worker has been quiet for
        `quiet` seconds or the trim has been due for `max_delay` seconds."""
        now = self.clock()
        quiet_at = self.last_active + self.quiet
        latest = self.due_since + self.max_delay
        return max(0.0, min(quiet_at, latest) - now)

    def done(self) -> None:
        self.running = False
        self.trims += 1

"""Give freed memory back to the operating system.

glibc keeps freed heap memory for reuse, and its mmap threshold grows with the largest block
freed (up to 32 MiB), so after the first large reply most records live in the heap rather
than in their own mappings. That reuse is what keeps R3 turns fast (fresh pages cost several
times a warm reuse on these VMs, docs/performance.md), but it also means a worker's RSS stays
at its high-water mark after every session is deleted (measured: 114 MiB -> 2.0 GiB after a
2-minute R3 soak whose sessions were all deleted). `malloc_trim(0)` returns the free pages
inside the heap, keeping the allocator's warm-reuse behaviour between trims.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)


def _load_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim  # type: ignore[no-any-return]


_MALLOC_TRIM = _load_malloc_trim()


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
    not thousands)."""

    def __init__(self, threshold: int = 64 << 20) -> None:
        self.threshold = threshold
        self.pending = 0
        self.trims = 0
        self.running = False

    def freed(self, nbytes: int, *, idle: bool = False) -> bool:
        """Record `nbytes` freed (`idle`: nothing is stored any more); True when a trim
        should start now."""
        self.pending += max(0, nbytes)
        enough = self.pending >= self.threshold or (idle and self.pending > 0)
        if self.running or not enough or _MALLOC_TRIM is None:
            return False
        self.running = True
        self.pending = 0
        return True

    def done(self) -> None:
        self.running = False
        self.trims += 1

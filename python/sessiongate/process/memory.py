"""Keep freed records' memory for reuse while a worker is busy; give it back once it is quiet.

An R3 turn's reply (~24 MiB) is received into a new `bytes` that its record keeps until the
session closes. Whether that memory is fresh or reused decides the turn's cost: the kernel
zeroes and maps fresh pages, about half of a turn's CPU on these VMs (docs/performance.md).
`keep_freed_records_warm` makes glibc keep the memory of closed sessions for the next ones.

`malloc_trim(0)` then gives the free pages back (measured before it: a worker stayed at
2.0 GiB after a 2-minute R3 soak whose sessions were all deleted). A trim waits for the
worker to go quiet: trimming between two sessions of a running load hands back exactly the
pages the next session's turns would have reused. Memory freed under steady load is trimmed
at the latest `max_delay` seconds later.

A trim keeps `--warm-records-bytes` (1 GiB) mapped: a rollout's next batch comes after a
training step, far more than 10 quiet seconds later, and its first touch of given-back
memory cost 30-34 ms of worker CPU per R3 turn of 23 MiB against 9 ms warm (measured:
docs/performance.md, "Warm memory across quiet spells").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


def _load_libc_function(
    name: str, argtypes: list[Any], restype: Any = ctypes.c_int
) -> Callable[..., Any] | None:
    library = ctypes.util.find_library("c")
    if library is None:
        return None
    try:
        function = getattr(ctypes.CDLL(library), name)
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return None
    function.argtypes = argtypes
    function.restype = restype
    return function


_MALLOC_TRIM = _load_libc_function("malloc_trim", [ctypes.c_size_t])
_MALLOPT = _load_libc_function("mallopt", [ctypes.c_int, ctypes.c_int])

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def keep_freed_records_warm() -> bool:
    """Make glibc keep and reuse the memory of freed records (a worker process, or the
    in-process gateway before its front's threads start; False where that is not
    available). Without it every R3 turn's reply lands in fresh pages:
    a body sink allocated in a thread comes from that thread's arena, whose 64 MiB heaps are
    unmapped as soon as they are empty, and blocks above the dynamic mmap threshold get their
    own mappings; the kernel then zeroes and faults in ~24 MiB per turn, about half of an
    R3 turn's CPU (docs/performance.md). One arena for every thread, blocks up to 32 MiB (the
    largest threshold glibc accepts) from the heap and no automatic trimming of its top: the
    next session reuses the pages warm, and `FreedMemoryTrimmer` gives them back once the
    worker goes quiet."""
    global _records_kept_in_heap
    _records_kept_in_heap = False
    if _MALLOPT is None:
        return False
    ok = _MALLOPT(_M_ARENA_MAX, 1)
    ok &= _MALLOPT(_M_MMAP_THRESHOLD, 32 << 20)
    ok &= _MALLOPT(_M_TRIM_THRESHOLD, 1 << 30)
    _records_kept_in_heap = bool(ok)
    return bool(ok)


# Set by keep_freed_records_warm: blocks of 1 MiB come from the heap and stay there when
# freed (else glibc maps each one apart and unmaps it on free, and a pre-fault is wasted).
_records_kept_in_heap = False


# For holding free memory allocated over a trim (release_free_memory).
_MALLOC = _load_libc_function("malloc", [ctypes.c_size_t], ctypes.c_void_p)
_FREE = _load_libc_function("free", [ctypes.c_void_p], None)
_SBRK = _load_libc_function("sbrk", [ctypes.c_ssize_t], ctypes.c_void_p)
# Blocks the kept memory is held in during a trim: below the 32 MiB mmap threshold that
# keep_freed_records_warm sets, so they come from the heap's free chunks.
_KEEP_BLOCK = 1 << 20
# Blocks the memory touched at start is allocated in: under the same threshold.
_TOUCH_BLOCK = 8 << 20


def release_free_memory(keep: int = 0) -> bool:
    """Return the allocator's free pages to the OS but about `keep` bytes of them, which
    stay mapped for the next sessions' records; False where that is not available. Takes
    milliseconds on a large heap: call it off the event loop.

    glibc cannot trim down to a size (`malloc_trim`'s pad only spares the heap's top), so the
    kept memory is allocated from the free chunks for the time of the trim, then freed again:
    those pages are still mapped and written, and the next records reuse them warm."""
    if _MALLOC_TRIM is None:
        return False
    held: list[int] = []
    try:
        if keep > 0 and _FREE is not None and _SBRK is not None:
            # Only memory the heap already has: a block that grew the heap is fresh pages
            # (nothing to keep), and freed with the others it would make the heap's top
            # large enough for glibc to trim it whole, kept pages included.
            held = _allocate_blocks(-(-keep // _KEEP_BLOCK), _KEEP_BLOCK, top=_SBRK(0))
        _MALLOC_TRIM(0)
    finally:
        if _FREE is not None:
            for block in held:
                _FREE(block)
    return True


def _allocate_blocks(count: int, size: int, *, top: int | None = None) -> list[int]:
    """Up to `count` blocks of `size` bytes (fewer when malloc fails); with `top` (the heap's
    end, `sbrk(0)`), the first block that moved it is the last one taken."""
    blocks: list[int] = []
    if _MALLOC is None:
        return blocks
    for _ in range(count):
        block = _MALLOC(size)
        if not block:
            break
        blocks.append(block)
        if top is not None and _SBRK is not None and _SBRK(0) != top:
            break
    return blocks


def prefault_free_memory(nbytes: int) -> int:
    """Touch about `nbytes` of the heap now and leave it free for the next records; the
    bytes touched (0 where that is not available). For a process's start, in a thread: a
    fresh gateway's first R3 turns otherwise fault in every record's pages, 52-60 ms of CPU
    a turn of 23 MiB against 7-9 ms once warm, where touching 1 GiB up front costs about
    0.55 s of CPU (docs/performance.md, "The cold first session").

    The blocks (of _TOUCH_BLOCK bytes: each ctypes call takes the GIL again, and a worker
    serving turns meanwhile holds it for up to 5 ms at a time, so 1 MiB blocks took seconds)
    are freed except the highest, which stays allocated for the process's life:
    it keeps the freed ones inside the heap rather than in its top, which glibc would trim
    at once once it passes the trim threshold, touched pages and all."""
    if nbytes < _TOUCH_BLOCK or not _records_kept_in_heap or _FREE is None:
        return 0
    blocks = _allocate_blocks(nbytes // _TOUCH_BLOCK, _TOUCH_BLOCK)
    if not blocks:
        return 0
    for block in blocks:
        ctypes.memset(block, 0, _TOUCH_BLOCK)
    pin = max(blocks)
    for block in blocks:
        if block != pin:
            _FREE(block)
    return len(blocks) * _TOUCH_BLOCK


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

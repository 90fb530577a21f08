"""Bulk bytes yield to a busy CPU: a records GET's file segments pause between slices while
the kernel reports that tasks wait for a CPU (PSI, /proc/pressure/cpu).

Sent as fast as the kernel copies, four clients reading 711 MiB GETs at once kept both cores
of a 2-core machine busy, and small chats running meanwhile had a p99 of 27-37 ms against
9-19 ms with the same GETs sent as frames. Pausing 1 ms before a slice while more than 80%
of the last 10 ms had a task waiting gave GETs at 870-920 MiB/s (frames: ~850) and small
chats' p99 at 9-14 ms (docs/performance.md, "Small requests while GETs run"). With cores to
spare, or without PSI (an old kernel, some containers), nothing pauses.

The compiled front does this on its bulk thread (rust/front/bulk.rs); this is its twin, for
the Python front.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

PSI_CPU = Path("/proc/pressure/cpu")
# How often the pressure is read, the share of that window with a task waiting above which
# sends pause, and the pause (the compiled front's constants).
WINDOW_S = 0.010
STALLED = 0.8
PAUSE_S = 0.001


def psi_some_total(text: str) -> int | None:
    """`total=N` of the first `some` line of a PSI file: microseconds some task was
    stalled. None when it is missing or not a u64 (as Rust's `str::parse` reads one)."""
    for line in text.split("\n"):
        if line.startswith("some "):
            for field in line.split():
                if field.startswith("total="):
                    value = field.removeprefix("total=")
                    digits = value.removeprefix("+")
                    if digits.isascii() and digits.isdigit() and int(digits) < 1 << 64:
                        return int(digits)
                    return None
            return None
    return None


def pauses(before: int | None, after: int | None, elapsed_us: int) -> bool:
    """Whether sends pause, from two readings `elapsed_us` apart; never without both. (In
    floats, as the compiled front compares.)"""
    if before is None or after is None:
        return False
    return float(max(after - before, 0)) > float(elapsed_us) * STALLED


def _read_stall_us() -> int | None:
    try:
        return psi_some_total(PSI_CPU.read_text())
    except OSError:
        return None


class Pressure:
    """The last reading and its verdict, refreshed at most once a window."""

    def __init__(self) -> None:
        self.read_at = time.monotonic()
        self.total_us = _read_stall_us()
        self.contended = False

    def check(self) -> bool:
        elapsed = time.monotonic() - self.read_at
        if elapsed < WINDOW_S:
            return self.contended
        total = _read_stall_us()
        self.contended = pauses(self.total_us, total, int(elapsed * 1_000_000))
        self.total_us = total
        self.read_at = time.monotonic()
        return self.contended


_PRESSURE: Pressure | None = None


async def yield_to_busy_cpu() -> None:
    """Before a bulk slice: a pause while the CPU is contended, else nothing."""
    global _PRESSURE
    if _PRESSURE is None:
        _PRESSURE = Pressure()
    if _PRESSURE.check():
        await asyncio.sleep(PAUSE_S)

"""Freed records go back to the OS in batches (process/memory.py)."""

from __future__ import annotations

import pytest

from sessiongate.process import memory
from sessiongate.process.memory import FreedMemoryTrimmer, release_free_memory


def test_release_free_memory_runs_where_glibc_is() -> None:
    if memory._MALLOC_TRIM is None:
        pytest.skip("no malloc_trim in this C library (not glibc)")
    assert release_free_memory() is True


def test_trims_are_batched_and_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_MALLOC_TRIM", lambda pad: 1)
    trimmer = FreedMemoryTrimmer(threshold=100)
    assert not trimmer.freed(60)
    assert trimmer.freed(60)  # 120 >= 100: start one
    assert not trimmer.freed(500)  # one is running: wait for it
    trimmer.done()
    assert trimmer.freed(1)  # 501 pending
    trimmer.done()
    assert not trimmer.freed(5)
    assert trimmer.freed(0, idle=True)  # the last session went: trim what is pending
    trimmer.done()
    assert not trimmer.freed(0, idle=True)  # nothing pending
    assert trimmer.trims == 3

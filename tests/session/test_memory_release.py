"""Freed records go back to the OS in batches (process/memory.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

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


def test_a_due_trim_waits_for_a_quiet_spell(monkeypatch: pytest.MonkeyPatch) -> None:
    # Trimming between two sessions of a running load returns the pages the next turns
    # would reuse warm: a due trim waits until requests stop, at most max_delay.
    monkeypatch.setattr(memory, "_MALLOC_TRIM", lambda pad: 1)
    now = [100.0]
    trimmer = FreedMemoryTrimmer(threshold=10, quiet=1.0, max_delay=30.0, clock=lambda: now[0])
    assert trimmer.wait() == 0  # never active: nothing to wait for
    trimmer.active()
    assert trimmer.freed(10)
    assert trimmer.wait() == 1.0
    now[0] += 0.5
    trimmer.active()  # the next request came: postpone
    assert trimmer.wait() == 1.0
    now[0] += 1.0
    assert trimmer.wait() == 0  # quiet for a second
    trimmer.done()
    # Under steady load the trim still runs once it has been due for max_delay.
    assert trimmer.freed(10)
    for _ in range(40):
        now[0] += 0.9
        trimmer.active()
    assert trimmer.wait() == 0


def test_core_trims_only_once_requests_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    from sessiongate.engines.pool import EnginePool
    from sessiongate.protocol import CoreRequest
    from sessiongate.session import core as core_module
    from sessiongate.session import freed_memory
    from sessiongate.session.settings import SessionSettings
    from sessiongate.tokenizer import load_tokenizer

    trims: list[int] = []
    monkeypatch.setattr(memory, "_MALLOC_TRIM", lambda pad: 1)
    # Patched where the core's trims call it.
    monkeypatch.setattr(
        freed_memory, "release_free_memory", lambda keep: bool(trims.append(keep)) or True
    )

    async def scenario() -> None:
        # Never contacted: creating sessions asks nothing of the upstream.
        core = core_module.SessionCore(
            load_tokenizer(None),
            EnginePool(["http://127.0.0.1:9"]),
            settings=SessionSettings(warm_records_bytes=5 << 20),
        )
        core.memory.trimmer = trimmer = FreedMemoryTrimmer(threshold=10, quiet=0.2)
        try:
            assert core.memory.freed(10)  # due: the trim starts, and waits for quiet
            for _ in range(5):  # a request every 0.1 s: the trim keeps waiting
                await core.handle(CoreRequest(op="create", body=b"{}"))
                await asyncio.sleep(0.1)
                assert not trims
            await asyncio.wait(core.memory.tasks, timeout=2)
            # It keeps --warm-records-bytes mapped.
            assert trims == [5 << 20] and trimmer.trims == 1 and not trimmer.running
        finally:
            await core.aclose()

    asyncio.run(scenario())


def test_workers_keep_freed_records_warm(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(
        memory, "_MALLOPT", lambda param, value: bool(calls.append((param, value))) or 1
    )
    assert memory.keep_freed_records_warm() is True
    # One arena (a body sink allocated in a thread reuses the heap's pages), blocks up to
    # 32 MiB from the heap, no automatic trim of its top (FreedMemoryTrimmer does that).
    assert calls == [(-8, 1), (-3, 32 << 20), (-1, 1 << 30)]
    monkeypatch.setattr(memory, "_MALLOPT", None)
    assert memory.keep_freed_records_warm() is False


KEEP_PROBE = """
import sys
from sessiongate.process import memory
memory.keep_freed_records_warm()
MIB = 1 << 20

def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 // MIB

base = rss()
blocks = [b"x" * (4 * MIB) for _ in range(24)]  # written: 96 MiB resident
del blocks
memory.release_free_memory(keep=int(sys.argv[1]) * MIB)
print(rss() - base, flush=True)
"""


@pytest.mark.procs
@pytest.mark.parametrize(("keep_mib", "low", "high"), [(64, 48, 110), (0, -20, 24)])
def test_a_trim_keeps_what_it_is_told_mapped(keep_mib: int, low: int, high: int) -> None:
    # In a process of its own: its heap holds only the probe's blocks. Of 96 MiB freed,
    # a trim keeping 64 MiB leaves about that resident; keeping nothing gives it all back.
    if memory._MALLOC_TRIM is None or memory._MALLOC is None or memory._SBRK is None:
        pytest.skip("no malloc_trim in this C library (not glibc)")
    probe = subprocess.run(
        [sys.executable, "-c", KEEP_PROBE, str(keep_mib)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    kept = int(probe.stdout)
    assert low <= kept <= high, f"{kept} MiB still resident after keeping {keep_mib} MiB"


PREFAULT_PROBE = """
import resource
import sys
from sessiongate.process import memory
if sys.argv[1] == "heap":
    memory.keep_freed_records_warm()
MIB = 1 << 20

def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 // MIB

def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

base = rss()
touched = memory.prefault_free_memory(64 * MIB) // MIB
after_touch = rss()
before = faults()
records = [b"x" * (4 * MIB) for _ in range(12)]  # 48 MiB of records, written
print(touched, after_touch - base, rss() - after_touch, faults() - before, flush=True)
"""


def prefault_probe(mode: str) -> list[int]:
    probe = subprocess.run(
        [sys.executable, "-c", PREFAULT_PROBE, mode],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return [int(field) for field in probe.stdout.split()]


@pytest.mark.procs
def test_memory_touched_at_start_takes_the_first_records_warm() -> None:
    # In a process of its own. 64 MiB touched at start stay resident once freed (inside the
    # heap, not its top, which glibc trims past the threshold), and the records written next
    # reuse them: a few faults where fresh memory takes one per page (12,288 for 48 MiB).
    if memory._MALLOPT is None or memory._MALLOC is None:
        pytest.skip("no mallopt in this C library (not glibc)")
    touched, resident, grown, faults = prefault_probe("heap")
    assert touched == 64
    assert resident >= 60, f"{resident} MiB resident after touching 64 MiB"
    assert grown <= 8, f"the records grew the process by {grown} MiB"
    assert faults < 1000, f"{faults} page faults writing 48 MiB of records"


@pytest.mark.procs
def test_nothing_is_touched_where_blocks_would_not_stay_in_the_heap() -> None:
    # Without keep_freed_records_warm glibc maps a 1 MiB block apart and unmaps it on free:
    # touching it would be lost work, so nothing is touched.
    touched, resident, _, _ = prefault_probe("default")
    assert touched == 0 and resident < 8


def test_only_r3_gateways_touch_records_memory_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    from sessiongate.session import freed_memory
    from sessiongate.session.freed_memory import FreedMemory
    from sessiongate.session.settings import SessionSettings

    machine = [64 << 30]
    monkeypatch.setattr(freed_memory, "memory_bytes", lambda: machine[0])

    def prefault(**fields: object) -> tuple[int, int]:
        freed = FreedMemory.for_settings(SessionSettings(**fields))  # type: ignore[arg-type]
        return freed.keep, freed.prefault

    assert prefault(warm_records_bytes=1 << 30) == (1 << 30, 0)  # small records: no need
    assert prefault(r3=True, warm_records_bytes=1 << 30) == (1 << 30, 1 << 30)
    # Never more than the worker may hold.
    assert prefault(r3=True, warm_records_bytes=1 << 30, max_records_bytes=1 << 28) == (
        1 << 30,
        1 << 28,
    )
    assert prefault(r3=True, warm_records_bytes=0) == (0, 0)
    # A 4 GiB container: a sixteenth of it per process, whatever is kept later.
    machine[0] = 4 << 30
    assert prefault(r3=True, warm_records_bytes=1 << 30) == (1 << 30, 256 << 20)

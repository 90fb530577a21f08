"""A records GET's segment files: a new file per segment against the worker's pooled files.

One 4 MiB segment's whole cycle as a local worker and its router run it
(dataplane/transport/reply_files.py): the worker writes the segment and links its name, the
router opens it, locks it and unlinks the name, the front closes it once sent (here at once).
`new`: a file of its own each time (tmpfs hands out fresh pages and frees them at the close);
`pooled`: one of the worker's kept files written again. In `/dev/shm` when it exists, as
`serve` does. docs/performance.md, "Segment files written again", has the figures.

Run with ``pytest benches/micro/bench_segment_files.py --benchmark-only``; with
``--benchmark-disable`` each case runs once as a test (results are still checked).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sessiongate.dataplane.transport import reply_files

SEGMENT = reply_files.SEGMENT


@pytest.fixture
def directory() -> Iterator[str]:
    where = reply_files.SHARED_MEMORY if reply_files.SHARED_MEMORY.is_dir() else None
    with tempfile.TemporaryDirectory(prefix="sg-bench-", dir=where) as path:
        yield path


@pytest.mark.parametrize("kind", ["new", "pooled"])
def test_segment_cycle(benchmark, directory: str, kind: str) -> None:  # type: ignore[no-untyped-def]
    pool = reply_files.SegmentPool(directory, keep=0 if kind == "new" else 2)
    data = [memoryview(os.urandom(SEGMENT))]
    loop = asyncio.new_event_loop()

    async def cycle() -> int:
        name = await pool.write(data, "b")
        assert name is not None
        part = reply_files.open_segment(directory, reply_files.segment_frame(name, SEGMENT))
        part.close()
        return part.length

    try:
        assert benchmark(lambda: loop.run_until_complete(cycle())) == SEGMENT
        # Every name was taken; a pooled cycle wrote one file over and over.
        assert not [p for p in Path(directory).iterdir() if p.name != reply_files.POOL_DIR]
        assert (pool.reused > 0, len(pool.files)) == ((False, 0) if kind == "new" else (True, 1))
    finally:
        loop.close()
        pool.close()

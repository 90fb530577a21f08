"""A `--r3` gateway touches its warm records memory at start (session/freed_memory.py), in
both layouts, so a fresh gateway's first sessions take their records warm."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from support.procs import ServerProcess, free_port

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

MIB = 1 << 20
WARM_MIB = 256


def rss_mib(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * 4096 // MIB


def sessions_process(gw: ServerProcess, workers: int) -> int:
    """The process that holds the records: the worker, or the gateway itself."""
    assert gw.proc is not None
    if workers == 0:
        return gw.proc.pid
    pids = [w["pid"] for w in httpx.get(gw.url + "/health").json()["workers"]]
    assert len(pids) == 1, pids
    return int(pids[0])


@pytest.mark.parametrize("workers", [0, 1])
def test_warm_records_memory_is_touched_at_start(workers: int) -> None:
    port = free_port()
    argv = ["serve", "--port", str(port), "--workers", str(workers), "--r3"]
    argv += ["--warm-records-bytes", f"{WARM_MIB}M"]
    with ServerProcess(argv, port, timeout=60) as gw:
        pid = sessions_process(gw, workers)
        # A gateway process is under 150 MiB before it holds records; touching runs in a
        # thread after start (about 0.5 s per GiB).
        deadline = time.monotonic() + 30
        while rss_mib(pid) < WARM_MIB and time.monotonic() < deadline:
            time.sleep(0.1)
        assert rss_mib(pid) >= WARM_MIB, f"{rss_mib(pid)} MiB resident"
        with httpx.Client(base_url=gw.url, timeout=60) as client:
            sid = client.post("/sessions").json()["session_id"]
            reply = client.post(
                f"/sessions/{sid}/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8},
            )
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["content"]

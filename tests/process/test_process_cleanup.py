"""No orphans: a gateway killed with SIGKILL takes its router, workers and mock engine with it;
SIGTERM stops everything cleanly with exit code 0."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from support.dataplane import reply_dir_of
from support.procs import ServerProcess, free_port

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for our purposes once it is not running.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


def _children(gateway: ServerProcess) -> tuple[str, list[int]]:
    match = re.search(r"mock-engine listening on (http://\S+)", gateway.output())
    assert match, gateway.output()
    workers = httpx.get(gateway.url + "/health").json()["workers"]
    return match.group(1), [w["pid"] for w in workers]


def _wait_gone(pids: list[int], urls: list[str], timeout: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [f"pid {p}" for p in pids if _alive(p)]
        for url in urls:
            try:
                httpx.get(url + "/health", timeout=0.5)
                alive.append(url)
            except httpx.HTTPError:
                pass
        if not alive:
            return []
        time.sleep(0.1)
    return alive


def test_sigkilled_serve_leaves_no_process() -> None:
    port = free_port()
    with ServerProcess(["serve", "--port", str(port), "--workers", "2"], port) as gateway:
        engine_url, worker_pids = _children(gateway)
        reply_dir = reply_dir_of(gateway)
        assert gateway.proc is not None
        supervisor = gateway.proc.pid
        children = Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()
        os.kill(supervisor, signal.SIGKILL)
        # Every child, the router included: it removes the directory after it stops
        # answering, so the check below waits for its exit, not just its silence.
        survivors = _wait_gone([*worker_pids, *map(int, children)], [engine_url, gateway.url])
        assert survivors == [], f"outlived their SIGKILLed supervisor: {survivors}"
        # Nor its shared-memory directory: the router removes it on its way out.
        assert reply_dir is None or not reply_dir.exists()


def test_sigterm_stops_serve_and_its_children() -> None:
    port = free_port()
    gateway = ServerProcess(["serve", "--port", str(port), "--workers", "2"], port).start()
    try:
        engine_url, worker_pids = _children(gateway)
        assert gateway.proc is not None
        gateway.proc.send_signal(signal.SIGTERM)
        assert gateway.proc.wait(timeout=15) == 0
        assert _wait_gone(worker_pids, [engine_url, gateway.url], timeout=5) == []
    finally:
        gateway.stop()

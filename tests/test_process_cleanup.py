"""No orphans: a gateway killed with SIGKILL takes its mock-engine child with it."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx

from procs import ServerProcess, free_port


def test_sigkilled_serve_leaves_no_mock_engine() -> None:
    port = free_port()
    with ServerProcess(["serve", "--port", str(port)], port) as gateway:
        match = re.search(r"upstream (http://127\.0\.0\.1:\d+)", gateway.output())
        assert match, gateway.output()
        engine_url = match.group(1)
        assert httpx.get(engine_url + "/health").status_code == 200
        assert gateway.proc is not None
        os.kill(gateway.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        alive = True
        while alive and time.monotonic() < deadline:
            try:
                httpx.get(engine_url + "/health", timeout=0.5)
                time.sleep(0.1)
            except httpx.HTTPError:
                alive = False
        assert not alive, "mock engine outlived its SIGKILLed parent"


def test_sigterm_stops_serve_and_its_engine() -> None:
    port = free_port()
    gateway = ServerProcess(["serve", "--port", str(port)], port).start()
    try:
        engine_url = re.search(r"upstream (http://\S+)\)", gateway.output())
        assert gateway.proc is not None and engine_url
        gateway.proc.send_signal(signal.SIGTERM)
        assert gateway.proc.wait(timeout=15) == 0
        try:
            httpx.get(engine_url.group(1) + "/health", timeout=0.5)
            raise AssertionError("mock engine still answering after serve exited")
        except httpx.HTTPError:
            pass
    finally:
        gateway.stop()

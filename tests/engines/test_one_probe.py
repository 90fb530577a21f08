"""One probe per engine per process: an engine stand-in counts the health probes a gateway
sends it over a few intervals, in both layouts. The registry's prober is the only one of
the router process (it feeds the compiled front) and of the in-process gateway (it feeds the
core's pool and the front); each worker process of the workers layout probes on its own."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from support.procs import ServerProcess, free_port

pytestmark = pytest.mark.procs

INTERVAL_S = 0.2
WINDOW_S = 2.0


class _Engine(ThreadingHTTPServer):
    daemon_threads = True
    health_probes = 0


class _Handler(BaseHTTPRequestHandler):
    server: _Engine

    def do_GET(self) -> None:
        if self.path == "/health":
            self.server.health_probes += 1  # one handler thread at a time per connection
            body = b""
        else:
            body = b'{"model_path": "stand-in"}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture()
def engine() -> Iterator[_Engine]:
    server = _Engine(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.mark.parametrize("workers", [2, 0], ids=["workers", "in-process"])
def test_each_process_probes_each_engine_once_per_interval(engine: _Engine, workers: int) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{engine.server_address[1]}"
    args = ["serve", "--port", str(port), "--workers", str(workers), "--backend", url]
    args += ["--health-interval", str(INTERVAL_S), "--front", "compiled"]
    with ServerProcess(args, port):
        time.sleep(INTERVAL_S)  # every process started probing
        before = engine.health_probes
        time.sleep(WINDOW_S)
        probes = engine.health_probes - before
    # The router (or the in-process gateway) and each worker: one prober each, probing at
    # most once per interval (a round's probe time comes on top of the interval).
    processes = 1 + workers
    most = processes * (WINDOW_S / INTERVAL_S + 2)
    assert 0 < probes <= most, (probes, most)

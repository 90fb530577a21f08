"""One probe per engine per process: an engine stand-in counts the health probes a gateway
sends it over a few intervals, in both layouts. The registry's prober is the only one of
the router process (it feeds the compiled front) and of the in-process gateway (it feeds the
core's pool and the front); each worker process of the workers layout probes on its own."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from support.http_stub import JsonStub, json_stub
from support.procs import ServerProcess, free_port

pytestmark = pytest.mark.procs

INTERVAL_S = 0.2
WINDOW_S = 2.0


@pytest.fixture()
def engine() -> Iterator[JsonStub]:
    """Healthy, with model info; counts the GETs by path."""
    with json_stub(b'{"model_path": "stand-in"}') as server:
        yield server


@pytest.mark.parametrize("workers", [2, 0], ids=["workers", "in-process"])
def test_each_process_probes_each_engine_once_per_interval(engine: JsonStub, workers: int) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{engine.port}"
    args = ["serve", "--port", str(port), "--workers", str(workers), "--backend", url]
    args += ["--health-interval", str(INTERVAL_S), "--front", "compiled"]
    with ServerProcess(args, port):
        time.sleep(INTERVAL_S)  # every process started probing
        before = engine.gets["/health"]
        time.sleep(WINDOW_S)
        probes = engine.gets["/health"] - before
    # The router (or the in-process gateway) and each worker: one prober each, probing at
    # most once per interval (a round's probe time comes on top of the interval).
    processes = 1 + workers
    most = processes * (WINDOW_S / INTERVAL_S + 2)
    assert 0 < probes <= most, (probes, most)

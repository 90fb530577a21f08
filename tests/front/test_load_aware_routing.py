"""least_load end to end: the gateway polls every engine's `GET /v1/loads` each
`--load-monitor-interval` and stateless requests go to the engine of lowest expected wait,
through the compiled front (its Rust policy, fed by the engine registry's poll) and the
Python front (the in-process core's pool fed the same way, or a worker's pool polling for
itself).

The engines are stubs whose `/v1/loads` says what the test sets, so the loads are known.
"""

from __future__ import annotations

import contextlib
import json
import time

import httpx
import pytest

from support.http_stub import CHAT_COMPLETION, LoopbackServer, QuietJsonHandler, serving
from support.procs import ServerProcess, free_port

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs


def loads(waiting_tokens: int, waiting_reqs: int = 0, token_usage: float = 0.1) -> bytes:
    rank = {
        "dp_rank": 0,
        "num_running_reqs": 0,
        "num_waiting_reqs": waiting_reqs,
        "num_waiting_uncached_tokens": waiting_tokens,
        "token_usage": token_usage,
        "gen_throughput": 1000.0,
    }
    return json.dumps({"timestamp": "t", "version": "0.5.23", "loads": [rank]}).encode()


class StubEngine(LoopbackServer):
    def __init__(self) -> None:
        self.loads = loads(0)
        self.posts = 0
        super().__init__(_Handler)


class _Handler(QuietJsonHandler):
    server: StubEngine

    def do_GET(self) -> None:
        self.send_json(self.server.loads if self.path.startswith("/v1/loads") else b"{}")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        with self.server.lock:
            self.server.posts += 1
        self.send_json(CHAT_COMPLETION)


def stub_engine() -> contextlib.AbstractContextManager[StubEngine]:
    return serving(StubEngine())


def send(gw: ServerProcess, engines: list[StubEngine], n: int) -> list[int]:
    before = [e.posts for e in engines]
    for i in range(n):
        body = {"messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 1}
        reply = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=30)
        assert reply.status_code == 200, reply.text
    return [e.posts - b for e, b in zip(engines, before, strict=True)]


@pytest.mark.parametrize(
    ("front", "layout"), [("compiled", "0"), ("python", "0"), ("compiled", "1"), ("python", "1")]
)
def test_least_load_follows_the_polled_loads(front: str, layout: str) -> None:
    with stub_engine() as a, stub_engine() as b:
        port = free_port()
        argv = ["serve", "--port", str(port), "--workers", layout, "--front", front]
        argv += ["--backend", a.url, "--backend", b.url, "--policy", "least_load"]
        argv += ["--load-monitor-interval", "1"]
        a.loads = loads(100_000)  # 100 s of queue
        with ServerProcess(argv, port, timeout=60) as gw:
            time.sleep(1.5)  # a poll has been
            assert send(gw, [a, b], 6) == [0, 6]
            a.loads, b.loads = loads(0), loads(100_000)
            time.sleep(2.5)  # the next poll has been
            assert send(gw, [a, b], 6) == [6, 0]


@pytest.mark.parametrize(("front", "layout"), [("compiled", "0"), ("python", "1")])
def test_overload_protection_leaves_an_overloaded_engine_out(front: str, layout: str) -> None:
    with stub_engine() as a, stub_engine() as b:
        port = free_port()
        argv = ["serve", "--port", str(port), "--workers", layout, "--front", front]
        argv += ["--backend", a.url, "--backend", b.url, "--policy", "round_robin"]
        argv += ["--worker-overload-protection", "--load-monitor-interval", "1"]
        a.loads = loads(0, waiting_reqs=8)  # smg's default threshold: 8 queued requests
        with ServerProcess(argv, port, timeout=60) as gw:
            time.sleep(1.5)  # a poll has been
            assert send(gw, [a, b], 6) == [0, 6]
            # KV usage at the threshold is overload too; both over: the fewer queued wins.
            a.loads, b.loads = loads(0, waiting_reqs=9), loads(0, token_usage=0.8)
            time.sleep(2.5)
            assert send(gw, [a, b], 6) == [0, 6]
            a.loads, b.loads = loads(0), loads(0)  # both under: round robin again
            time.sleep(2.5)
            assert send(gw, [a, b], 6) == [3, 3]

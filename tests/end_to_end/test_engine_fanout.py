"""The SGLang Model Gateway's fan-out routes and the per-engine gauges, in every layout:
real gateways (`sessiongate serve`) in front of three real mock engines on loopback.

- `/flush_cache` (the rollout framework's prefill scoring posts it to the router): every
  engine flushed is a 200; a busy engine (SGLang answers 400) or a dead one is the
  Gateway's 206 `partial_success`, naming it.
- `GET /engine_metrics` (the framework's dashboard scrapes it): every engine's `/metrics`
  merged, each sample labelled `worker_addr`; a dead engine is left out, the route still 200.
- `/metrics`: `sessiongate_engine_requests_in_flight`, `_requests_total` and `_healthy` per
  engine, whichever path relayed the request (the compiled front itself, a worker's pool).

The tests of one layout run in file order on one gateway; the last one kills an engine.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import httpx
import pytest

from support.procs import ServerProcess, free_port, mock_engine

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

LAYOUTS = {
    "workers 0, compiled front": ("--workers", "0", "--front", "compiled"),
    "workers 0, python front": ("--workers", "0", "--front", "python"),
    "workers 1, compiled front": ("--workers", "1", "--front", "compiled"),
    "workers 1, python front": ("--workers", "1", "--front", "python"),
}
# 2 ms a token: a 400-token request keeps an engine busy for about a second, a 4-token one
# is quick.
TOKEN_DELAY_MS = "2"
SHORT = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}
LONG = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}


@dataclass
class Setup:
    gateway: ServerProcess
    engines: list[ServerProcess]

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]


@pytest.fixture(scope="module", params=list(LAYOUTS))
def setup(request: pytest.FixtureRequest) -> Iterator[Setup]:
    with ExitStack() as stack:
        engines = [
            stack.enter_context(mock_engine("--token-delay-ms", TOKEN_DELAY_MS)) for _ in range(3)
        ]
        port = free_port()
        argv = ["serve", "--port", str(port), "--health-interval", "0.5", *LAYOUTS[request.param]]
        for engine in engines:
            argv += ["--backend", engine.url]
        gateway = stack.enter_context(ServerProcess(argv, port, timeout=60))
        yield Setup(gateway, engines)


def busy(url: str, body: dict[str, object]) -> threading.Thread:
    """A long request to `url`, running in the background until joined."""
    thread = threading.Thread(target=lambda: httpx.post(url, json=body, timeout=30))
    thread.start()
    return thread


def wait_for(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def in_flight(engine: ServerProcess) -> int:
    count: int = httpx.get(engine.url + "/mock/stats").json()["in_flight"]
    return count


def samples(text: str, name: str) -> dict[str, float]:
    """`{engine url: value}` of a family labelled by `engine` or `worker_addr`."""
    found: dict[str, float] = {}
    pattern = re.compile(rf'^{name}\{{.*(?:engine|worker_addr)="([^"]+)".*\}} (\S+)$')
    for line in text.splitlines():
        match = pattern.match(line)
        if match:
            found[match.group(1)] = float(match.group(2))
    return found


def metrics(setup: Setup) -> str:
    reply = httpx.get(setup.gateway.url + "/metrics", timeout=10)
    assert reply.status_code == 200
    return reply.text


def test_flush_cache_flushes_every_engine(setup: Setup) -> None:
    for method in ("POST", "GET"):  # the Gateway's POST, and SGLang's own GET
        reply = httpx.request(method, setup.gateway.url + "/flush_cache", timeout=30)
        assert reply.status_code == 200, reply.text
        document = reply.json()
        assert document["status"] == "success"
        assert document["workers_flushed"] == document["total_workers"] == 3
        assert "failed" not in document
        assert [(e["url"], e["status"], e["flushed"]) for e in document["engines"]] == [
            (url, 200, True) for url in setup.urls
        ]


def test_flush_cache_names_a_busy_engine(setup: Setup) -> None:
    engine = setup.engines[1]
    thread = busy(engine.url + "/generate", LONG)
    try:
        wait_for(lambda: in_flight(engine) == 1)
        reply = httpx.post(setup.gateway.url + "/flush_cache", json={}, timeout=30)
    finally:
        thread.join()
    assert reply.status_code == 206, reply.text
    document = reply.json()
    assert document["status"] == "partial_success"
    assert document["workers_flushed"] == 2
    assert document["successful"] == [setup.urls[0], setup.urls[2]]
    assert document["failed"] == [{"worker": engine.url, "error": "HTTP 400 Bad Request"}]
    failed = document["engines"][1]
    assert failed["flushed"] is False and failed["status"] == 400
    assert failed["reply"] == "Flush cache failed.\n"  # SGLang's text, from the engine


def test_engine_metrics_merges_every_engine(setup: Setup) -> None:
    reply = httpx.get(setup.gateway.url + "/engine_metrics", timeout=30)
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = reply.text
    # Every engine, labelled with its URL under the Gateway's label and names ("_" for ":").
    running = samples(text, "sglang_num_running_reqs")
    assert running == {url: 0.0 for url in setup.urls}
    assert set(samples(text, "sglang_prompt_tokens_total")) == set(setup.urls)
    assert samples(text, "sessiongate_engine_metrics_up") == {url: 1.0 for url in setup.urls}
    # One HELP and one TYPE per family, before its samples.
    for family in ("sglang_num_running_reqs", "sglang_prompt_tokens_total"):
        assert text.count(f"# HELP {family} ") == 1
        assert text.count(f"# TYPE {family} ") == 1
        assert text.index(f"# TYPE {family} ") < text.index(f"\n{family}{{")
    # The engines' own labels are kept.
    assert (
        f'engine_type="unified",tp_rank="0",pp_rank="0",moe_ep_rank="0",worker_addr="{setup.urls[0]}"'
        in text
    )


def test_metrics_has_per_engine_gauges(setup: Setup) -> None:
    before = samples(metrics(setup), "sessiongate_engine_requests_total")
    assert set(before) == set(setup.urls)
    assert samples(metrics(setup), "sessiongate_engine_healthy") == {u: 1.0 for u in setup.urls}
    # Stateless requests: relayed by the compiled front itself, or by a worker's pool.
    for _ in range(6):
        reply = httpx.post(setup.gateway.url + "/generate", json=SHORT, timeout=30)
        assert reply.status_code == 200, reply.text
    # A session turn goes through the session core's pool, counted too.
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    reply = httpx.post(
        setup.gateway.url + "/v1/chat/completions",
        json=chat,
        headers={"X-Session-ID": "fanout-gauges"},
        timeout=30,
    )
    assert reply.status_code == 200, reply.text

    def counted() -> bool:
        after = samples(metrics(setup), "sessiongate_engine_requests_total")
        return sum(after.values()) - sum(before.values()) >= 7

    wait_for(counted)  # workers report on their heartbeat
    # A long request shows in flight on one engine while it runs, and leaves.
    thread = busy(setup.gateway.url + "/generate", LONG)
    try:
        wait_for(
            lambda: (
                sum(samples(metrics(setup), "sessiongate_engine_requests_in_flight").values()) == 1
            )
        )
        running = samples(metrics(setup), "sessiongate_engine_requests_in_flight")
        (busy_url,) = [url for url, n in running.items() if n == 1]
        assert in_flight(setup.engines[setup.urls.index(busy_url)]) == 1
    finally:
        thread.join()
    wait_for(
        lambda: sum(samples(metrics(setup), "sessiongate_engine_requests_in_flight").values()) == 0
    )


def test_a_dead_engine_is_named_and_left_out(setup: Setup) -> None:
    # Last of the layout's tests: the engine stays dead.
    dead = setup.engines[2]
    dead.stop()
    reply = httpx.post(setup.gateway.url + "/flush_cache", timeout=30)
    assert reply.status_code == 206, reply.text
    document = reply.json()
    assert document["successful"] == setup.urls[:2]
    assert [f["worker"] for f in document["failed"]] == [dead.url]
    assert document["engines"][2]["status"] is None

    reply = httpx.get(setup.gateway.url + "/engine_metrics", timeout=30)
    assert reply.status_code == 200
    assert set(samples(reply.text, "sglang_num_running_reqs")) == set(setup.urls[:2])
    assert samples(reply.text, "sessiongate_engine_metrics_up") == {
        setup.urls[0]: 1.0,
        setup.urls[1]: 1.0,
        dead.url: 0.0,
    }
    assert f"# sessiongate: engine {dead.url} left out: " in reply.text
    # The registry's probe notices it within a few health intervals.
    wait_for(lambda: samples(metrics(setup), "sessiongate_engine_healthy")[dead.url] == 0.0)
    assert samples(metrics(setup), "sessiongate_engine_healthy")[setup.urls[0]] == 1.0


@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_registered_engine_fans_out_and_counts(workers: str) -> None:
    """An engine registered at run time beside the static one: the compiled front relays
    stateless requests to the new set (its pool swapped, the static engine's count kept)
    and the workers' pools count the session turns; with two workers both report, and the
    router sums them with the front's counts."""
    with ExitStack() as stack:
        static, registered = (stack.enter_context(mock_engine()) for _ in range(2))
        port = free_port()
        argv = ["serve", "--port", str(port), "--workers", workers, "--front", "compiled"]
        argv += ["--backend", static.url, "--health-interval", "0.5"]
        # Both engines must get requests to be counted: cache_aware (the default) would
        # keep these identical bodies on one.
        argv += ["--policy", "round_robin"]
        gateway = stack.enter_context(ServerProcess(argv, port, timeout=60))
        client = httpx.Client(base_url=gateway.url, timeout=30)
        setup = Setup(gateway, [static, registered])
        for _ in range(2):  # relayed by the compiled front itself
            assert client.post("/generate", json=SHORT).status_code == 200
        reply = client.post("/workers", json={"url": registered.url, "worker_type": "regular"})
        assert reply.status_code == 202, reply.text
        wait_for(
            lambda: set(samples(metrics(setup), "sessiongate_engine_healthy")) == set(setup.urls)
        )
        for _ in range(4):  # relayed by the compiled front's new pool
            assert client.post("/generate", json=SHORT).status_code == 200
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        for index in range(4):  # turns of four sessions, spread over the workers
            headers = {"X-Session-ID": f"registered-{index}"}
            reply = client.post("/v1/chat/completions", json=chat, headers=headers)
            assert reply.status_code == 200, reply.text

        def counted() -> bool:
            sent = samples(metrics(setup), "sessiongate_engine_requests_total")
            return sent.get(registered.url, 0) > 0 and sum(sent.values()) >= 10

        wait_for(counted)
        reply = client.post("/flush_cache")
        assert reply.status_code == 200, reply.text
        assert [e["url"] for e in reply.json()["engines"]] == setup.urls
        text = client.get("/engine_metrics").text
        assert set(samples(text, "sglang_num_running_reqs")) == set(setup.urls)

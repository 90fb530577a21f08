"""Engine-facing retries and circuit breakers end to end: `sessiongate serve` processes in
front of the mock engine, a fault proxy scripting its replies, or a port nobody listens on.
Each case runs through the compiled front's relay (stateless requests, rust/front/upstream.rs)
and through the Python upstream pool (`--front python`, and session turns), with backoffs and
timeouts shrunk by flags so the module takes seconds."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from support.fault_proxy import FaultProxy
from support.procs import ServerProcess, free_port, mock_engine

pytestmark = pytest.mark.procs

BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
FAST = [
    "--health-interval",
    "0.2",
    "--retry-initial-backoff-ms",
    "10",
    "--retry-max-backoff-ms",
    "40",
]
# Stateless through the Rust relay, stateless through the Python pool, a session turn.
ROUTES = ["compiled", "python", "session"]


@pytest.fixture(scope="module")
def engine() -> Iterator[ServerProcess]:
    with mock_engine() as running:
        yield running


@pytest.fixture
def proxy(engine: ServerProcess) -> Iterator[FaultProxy]:
    with FaultProxy(engine.port) as running:
        running.spare_probes = True
        yield running


def gateway(route: str, backends: list[str], *flags: str) -> ServerProcess:
    port = free_port()
    front = "python" if route == "python" else "compiled"
    # Round robin whatever the default policy: the tests count where requests go.
    args = ["serve", "--workers", "0", "--port", str(port), "--front", front, "--policy"]
    args += ["round_robin", *FAST, *flags]
    for url in backends:
        args += ["--backend", url]
    return ServerProcess(args, port)


def send(client: httpx.Client, route: str) -> int:
    headers = {"x-session-id": "family-1"} if route == "session" else {}
    return client.post("/v1/chat/completions", json=BODY, headers=headers).status_code


def breaker_states(client: httpx.Client, route: str) -> dict[str, str]:
    """URL -> breaker state of whichever side serves `route`."""
    if route == "compiled":
        text = client.get("/metrics").text
        names = {"0": "closed", "1": "open", "2": "half_open"}
        states = {}
        for line in text.splitlines():
            if line.startswith("sessiongate_front_upstream_circuit_breaker_state{"):
                labels, value = line.rsplit(" ", 1)
                states[labels.split('url="')[1].rstrip('"}')] = names[value]
        return states
    return {u["url"]: u["circuit_breaker"] for u in client.get("/health").json()["upstreams"]}


@pytest.mark.parametrize("route", ROUTES)
def test_503_twice_then_200_goes_through_with_retries(proxy: FaultProxy, route: str) -> None:
    with gateway(route, [proxy.url]) as gw, httpx.Client(base_url=gw.url, timeout=10) as client:
        assert send(client, route) == 200  # a session's first turn asks /model_info too
        before = proxy.requests
        proxy.script("http503", "http503")
        assert send(client, route) == 200
        assert proxy.requests - before == 3
        assert proxy.counts["http503"] == 2
        metrics = client.get("/metrics").text
        family = (
            "sessiongate_front_upstream_retries_total"
            if route == "compiled"
            else "sessiongate_upstream_retries_total"
        )
        assert any(line.startswith(family) and line.endswith(" 2") for line in metrics.splitlines())


@pytest.mark.parametrize("route", ROUTES)
def test_with_retries_disabled_the_503_is_the_reply(proxy: FaultProxy, route: str) -> None:
    with (
        gateway(route, [proxy.url], "--disable-retries") as gw,
        httpx.Client(base_url=gw.url, timeout=10) as client,
    ):
        assert send(client, route) == 200
        before = proxy.requests
        proxy.script("http503")
        assert send(client, route) == 503
        assert proxy.requests - before == 1
        # 429 likewise is never retried with retries off.
        proxy.script("http429")
        assert send(client, route) == 429


@pytest.mark.parametrize("route", ["compiled", "python"])
def test_a_refusing_engine_among_two_costs_no_stateless_request(
    engine: ServerProcess, route: str
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with (
        gateway(route, [dead, engine.url], "--health-interval", "60") as gw,
        httpx.Client(base_url=gw.url, timeout=10) as client,
    ):
        statuses = [send(client, route) for _ in range(20)]
        assert statuses == [200] * 20
        upstreams = (
            {u["url"]: u for u in client.get("/health").json()["upstreams"]}
            if route == "python"
            else {}
        )
        if upstreams:
            assert upstreams[dead]["healthy"] is False


@pytest.mark.parametrize("route", ["compiled", "python"])
def test_the_breaker_opens_keeps_traffic_away_then_half_opens(
    engine: ServerProcess, proxy: FaultProxy, route: str
) -> None:
    proxy.set_mode("http500")
    flags = [
        "--cb-failure-threshold",
        "3",
        "--cb-success-threshold",
        "2",
        "--cb-timeout-duration-secs",
        "1.5",
    ]
    with (
        gateway(route, [proxy.url, engine.url], *flags) as gw,
        httpx.Client(base_url=gw.url, timeout=10) as client,
    ):
        statuses = [send(client, route) for _ in range(8)]
        # Round robin: the failing engine gets every other request until its third 500.
        assert statuses.count(500) == 3 and proxy.requests == 3
        assert breaker_states(client, route)[proxy.url] == "open"
        opened = time.monotonic()
        assert [send(client, route) for _ in range(10)] == [200] * 10
        assert proxy.requests == 3  # no traffic while open
        proxy.set_mode("pass")
        time.sleep(max(0.0, 1.5 - (time.monotonic() - opened)) + 0.1)
        assert [send(client, route) for _ in range(6)] == [200] * 6
        assert proxy.requests >= 5  # half-open: trial requests reach it again
        assert breaker_states(client, route)[proxy.url] == "closed"

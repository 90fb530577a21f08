"""Upstream state in /health and /metrics, and `serve` on a port someone else answers on.

Real processes throughout: a mock engine that is stopped and restarted on the same port under
a gateway in both layouts (workers and in-process), and a plain HTTP server squatting on the
gateway's port.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from sessiongate.config.front import ListenConfig
from sessiongate.config.gateway import GatewayConfig
from sessiongate.config.launch import RouterLaunch
from sessiongate.dataplane.placement.supervisor import Supervisor, SupervisorConfig
from sessiongate.engines.client import EngineUnreachable
from sessiongate.engines.pool import EnginePool
from support.http_stub import json_stub
from support.procs import ServerProcess, free_port, mock_engine

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

HEALTH_INTERVAL = "0.2"
# Generous liveness deadline: state changes are expected within a few health intervals.
DEADLINE_S = 20.0
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def wait_for(predicate: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + DEADLINE_S
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(0.05)
    raise AssertionError(f"{what} not seen within {DEADLINE_S}s (last: {last!r})")


def upstream_states(health: dict[str, Any]) -> list[dict[str, Any]]:
    """Every upstream entry of a /health document, whatever the layout."""
    if "workers" in health:
        return [u for worker in health["workers"] for u in worker["upstreams"]]
    return list(health["upstreams"])


def upstream_up_samples(metrics: str, url: str) -> list[int]:
    pattern = rf'^sessiongate_upstream_up\{{worker="\d+",url="{re.escape(url)}"\}} (\d+)$'
    return [int(m.group(1)) for m in re.finditer(pattern, metrics, re.MULTILINE)]


@pytest.mark.parametrize("workers", ["2", "0"], ids=["workers", "in-process"])
def test_engine_outage_shows_in_health_and_metrics(workers: str) -> None:
    engine = mock_engine().start()
    try:
        port = free_port()
        args = ["serve", "--port", str(port), "--workers", workers, "--backend", engine.url]
        with ServerProcess([*args, "--health-interval", HEALTH_INTERVAL], port) as gateway:
            with httpx.Client(base_url=gateway.url, timeout=30) as client:
                health = client.get("/health").json()
                assert health["status"] == "ok" and health["upstream"] == "ok", health
                states = upstream_states(health)
                assert len(states) == (int(workers) or 1), health
                assert all(s["url"] == engine.url and s["healthy"] for s in states), health
                session = client.post("/sessions").json()["session_id"]
                turn = f"/sessions/{session}/v1/chat/completions"
                assert client.post(turn, json=CHAT).status_code == 200

                engine.stop()

                def down() -> dict[str, Any] | None:
                    # Each worker probes on its own clock: wait until every one has seen it.
                    document = client.get("/health").json()
                    seen = not any(s["healthy"] for s in upstream_states(document))
                    return document if seen and document.get("upstream") == "down" else None

                health = wait_for(down, "upstream down in /health")
                # Still 200: an orchestrator restarting the gateway would not bring the engine
                # back, and would drop every session's records.
                assert client.get("/health").status_code == 200
                assert health["status"] == "degraded" and engine.url in health["reason"]
                assert all(
                    not s["healthy"] and engine.url in s["last_error"]
                    for s in upstream_states(health)
                ), health
                # Load balancers that must stop routing ask for the strict answer.
                assert client.get("/health", params={"upstream": "required"}).status_code == 503
                failed = client.post(turn, json=CHAT)
                assert failed.status_code == 502 and engine.url in failed.json()["error"]
                metrics = client.get("/metrics").text
                assert upstream_up_samples(metrics, engine.url) == [0] * (int(workers) or 1)

                # The same engine back on the same port: up again, turns work again.
                engine = ServerProcess(["mock-engine", "--port", str(engine.port)], engine.port)
                engine.start()

                def up() -> dict[str, Any] | None:
                    document = client.get("/health").json()
                    seen = all(s["healthy"] for s in upstream_states(document))
                    return document if seen and document.get("upstream") == "ok" else None

                health = wait_for(up, "upstream up again in /health")
                assert health["status"] == "ok" and "reason" not in health, health
                assert all(s["healthy"] and "last_error" not in s for s in upstream_states(health))
                assert client.get("/health", params={"upstream": "required"}).status_code == 200
                assert client.post(turn, json=CHAT).status_code == 200
                metrics = client.get("/metrics").text
                assert upstream_up_samples(metrics, engine.url) == [1] * (int(workers) or 1)
    finally:
        engine.stop()


def test_request_transport_failure_marks_down_and_success_marks_up() -> None:
    """Without waiting for a probe: a refused turn marks the upstream down at once, a turn
    that gets a reply marks it up (the pool's prober is never started here)."""
    engine = mock_engine().start()
    port = engine.port
    body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'

    async def scenario() -> None:
        pool = EnginePool([engine.url], health_interval=3600)
        try:
            assert (await pool.post_json(None, "/v1/chat/completions", body)).status == 200
            engine.stop()
            with pytest.raises(EngineUnreachable):
                await pool.post_json(None, "/v1/chat/completions", body)
            assert pool.status()["upstream"] == "down"
            (state,) = pool.upstream_states()
            assert state["healthy"] is False and engine.url in str(state["last_error"])
            restarted = ServerProcess(["mock-engine", "--port", str(port)], port)
            with restarted:
                assert (await pool.post_json(None, "/v1/chat/completions", body)).status == 200
                # The refused request was sent 5 times (--retry-max-retries): 4 retries.
                assert pool.upstream_states() == [
                    {"url": engine.url, "healthy": True, "circuit_breaker": "closed", "retries": 4}
                ]
                assert pool.status()["upstream"] == "ok"
        finally:
            await pool.aclose()

    try:
        asyncio.run(scenario())
    finally:
        engine.stop()


# -- serve on a port another process already answers /health on -------------------------


@pytest.fixture()
def impostor() -> Iterator[int]:
    """A plain HTTP server on a thread answering 200 on /health (and any GET); yields its
    port."""
    with json_stub() as server:
        yield server.port


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("workers", ["1", "0"], ids=["workers", "in-process"])
def test_serve_on_a_port_in_use_fails_clearly(impostor: int, workers: str) -> None:
    # The default mock backend, so there is a child (the mock engine) that must not survive.
    command = ["serve", "--port", str(impostor), "--workers", workers]
    proc = subprocess.Popen(
        [sys.executable, "-m", "sessiongate", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0, (stdout, stderr)
    assert b"serving on" not in stdout, stdout
    assert f"port {impostor} is in use".encode() in stderr, stderr
    assert wait_for(lambda: _group_gone(proc.pid), "every child of serve gone")


def test_readiness_is_proven_by_our_router_not_by_whoever_answers(impostor: int) -> None:
    """The supervisor's readiness check does not take another server's 200 for its router's."""
    config = GatewayConfig(listen=ListenConfig(host="127.0.0.1", port=impostor))
    router = RouterLaunch(config, port=impostor, control_fd=-1)
    supervisor = Supervisor(SupervisorConfig(workers=1, router=router, worker_config=config))
    assert httpx.get(f"http://127.0.0.1:{impostor}/health").status_code == 200
    assert supervisor._ready() is False

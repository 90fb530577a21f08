"""The multi-process data plane with real processes: router isolation, equivalence across
worker counts, worker loss (restart and fail-fast), client disconnects, health under load."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sessiongate.demo.verify import trajectory_problems
from sessiongate.primitives import shard_index, shard_key
from support.dataplane import _equivalence_script, start_messages
from support.procs import ServerProcess, free_port

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

SLOW_MOCK = "--token-delay-ms 25 --completion-tokens 40 --completion-tokens-jitter 0"


def worker_pid(gateway: ServerProcess, session_id: str) -> int:
    workers = httpx.get(gateway.url + "/health").json()["workers"]
    owner = shard_index(shard_key(session_id), len(workers))
    pid: int = workers[owner]["pid"]
    return pid


def wait_health(url: str, status: int, timeout: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        response = httpx.get(url + "/health", timeout=2)
        last = response.json()
        if response.status_code == status:
            return last
        time.sleep(0.05)
    raise AssertionError(f"/health never answered {status}: {last}")


def test_router_never_loads_session_core_or_tokenizer(tmp_path: Path) -> None:
    report = tmp_path / "modules.json"
    port = free_port()
    with ServerProcess(
        ["serve", "--port", str(port), "--workers", "1"],
        port,
        env={"SESSIONGATE_ROUTER_MODULES_REPORT": str(report)},
    ) as gateway:
        session_id = httpx.post(gateway.url + "/sessions").json()["session_id"]
        chat = httpx.post(
            f"{gateway.url}/sessions/{session_id}/v1/chat/completions",
            json={"messages": start_messages()},
        )
        assert chat.status_code == 200
    # Written when the router stops, after it served traffic.
    modules = set(json.loads(report.read_text()))
    assert "sessiongate.dataplane.router.shard_router" in modules
    forbidden = {"sessiongate.session.core", "sessiongate.tokenizer", "tokenizers", "jinja2"}
    # FastAPI serves only /openapi.json and /docs, imported on their first request.
    forbidden |= {"fastapi", "sessiongate.front.openapi", "sessiongate.front.schemas"}
    assert not modules & forbidden, modules & forbidden


def test_one_worker_and_three_workers_answer_identically() -> None:
    results = []
    for workers in (1, 3):
        port = free_port()
        with ServerProcess(["serve", "--port", str(port), "--workers", str(workers)], port) as gw:
            results.append(_equivalence_script(gw.url, cover=workers))
    (one, _), (three, owners) = results
    assert owners == {0, 1, 2}, "every worker should serve sessions"
    assert len(one) == len(three)
    for left, right in zip(one, three, strict=True):
        assert left == right


@pytest.fixture()
def slow_gateway(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    policy = getattr(request, "param", "restart")
    port = free_port()
    with ServerProcess(
        [
            "serve",
            "--port",
            str(port),
            "--workers",
            "2",
            "--on-worker-exit",
            policy,
            "--mock-args",
            SLOW_MOCK,
        ],
        port,
    ) as proc:
        yield proc


def test_killed_worker_fails_in_flight_turn_and_is_restarted(slow_gateway: ServerProcess) -> None:
    url = slow_gateway.url

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            sid = (await c.post("/sessions")).json()["session_id"]
            pid = worker_pid(slow_gateway, sid)
            turn = asyncio.create_task(
                c.post(f"/sessions/{sid}/v1/chat/completions", json={"messages": start_messages()})
            )
            await asyncio.sleep(0.3)
            os.kill(pid, signal.SIGKILL)
            started = time.monotonic()
            reply = await turn
            assert reply.status_code == 503
            assert time.monotonic() - started < 5
            error = reply.json()["error"]
            assert "is down" in error and f"session {sid} was lost with its worker" in error

            healthy = await asyncio.to_thread(wait_health, url, 200)
            assert {w["generation"] for w in healthy["workers"]} == {0, 1}
            gone = await c.get(f"/sessions/{sid}")
            assert gone.status_code == 404 and "restarted" in gone.json()["error"]
            # The restarted shard serves new sessions again.
            for n in range(6):
                fresh = (await c.post("/sessions")).json()["session_id"]
                answer = await c.post(
                    f"/sessions/{fresh}/v1/chat/completions",
                    json={"messages": start_messages(str(n)), "max_tokens": 2},
                )
                assert answer.status_code == 200
            metrics = (await c.get("/metrics")).text
            assert "sessiongate_worker_restarts_total 1" in metrics

    asyncio.run(scenario())


def test_fail_policy_exits_non_zero_and_leaves_nothing() -> None:
    port = free_port()
    gateway = ServerProcess(
        ["serve", "--port", str(port), "--workers", "2", "--on-worker-exit", "fail"], port
    ).start()
    try:
        workers = httpx.get(gateway.url + "/health").json()["workers"]
        os.kill(workers[1]["pid"], signal.SIGKILL)
        assert gateway.proc is not None
        try:
            code = gateway.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"serve did not exit:\n{gateway.output()}") from None
        assert code == 1
        for worker in workers:
            with pytest.raises(ProcessLookupError):
                _wait_exit(worker["pid"])
        with pytest.raises(httpx.HTTPError):
            httpx.get(gateway.url + "/health", timeout=1)
    finally:
        gateway.stop()


def _wait_exit(pid: int, timeout: float = 10) -> None:
    """Raises ProcessLookupError once `pid` is gone (reaped or never a zombie for long)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        os.kill(pid, 0)
        stat = Path(f"/proc/{pid}/stat")
        if stat.exists() and stat.read_text().split(") ")[-1].startswith("Z"):
            raise ProcessLookupError(pid)
        time.sleep(0.05)


def test_client_disconnect_mid_turn_leaves_session_consistent(slow_gateway: ServerProcess) -> None:
    sid = httpx.post(slow_gateway.url + "/sessions").json()["session_id"]
    path = f"{slow_gateway.url}/sessions/{sid}/v1/chat/completions"
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(path, json={"messages": start_messages()}, timeout=0.3)
    time.sleep(1.5)  # let the abandoned turn finish on the worker
    session = httpx.get(f"{slow_gateway.url}/sessions/{sid}").json()
    assert len(session["records"]) in (0, 1)
    assert trajectory_problems(session) == []
    messages = start_messages()
    if session["records"]:
        messages.append(session["records"][0]["response"]["choices"][0]["message"])
        messages.append({"role": "user", "content": "next"})
    follow_up = httpx.post(path, json={"messages": messages}, timeout=30)
    assert follow_up.status_code == 200
    final = httpx.get(f"{slow_gateway.url}/sessions/{sid}").json()
    assert trajectory_problems(final) == []


def test_health_stays_fast_while_workers_parse_large_replies() -> None:
    port = free_port()
    # 512 layers x 8 experts x 4 bytes = 16 KiB of R3 per token: ~1000-token turns carry
    # ~16 MiB of routed experts (~21 MiB of base64) for each worker to parse and record.
    with ServerProcess(
        [
            "serve",
            "--port",
            str(port),
            "--workers",
            "2",
            "--r3",
            "--mock-args",
            "--r3-layers 512 --r3-topk 8 --completion-tokens 32",
        ],
        port,
    ) as gateway:
        long_prompt = [{"role": "user", "content": " ".join(["word"] * 1000)}]

        async def scenario() -> list[float]:
            async with httpx.AsyncClient(base_url=gateway.url, timeout=120) as c:
                sids = [(await c.post("/sessions")).json()["session_id"] for _ in range(6)]

                async def turns(sid: str) -> None:
                    for _ in range(2):
                        r = await c.post(
                            f"/sessions/{sid}/v1/chat/completions", json={"messages": long_prompt}
                        )
                        assert r.status_code == 200, r.text
                        break

                load = asyncio.gather(*(turns(s) for s in sids))
                latencies: list[float] = []
                while not load.done():
                    started = time.monotonic()
                    health = await c.get("/health")
                    latencies.append(time.monotonic() - started)
                    assert health.status_code == 200
                    await asyncio.sleep(0.05)
                await load
                return latencies

        latencies = asyncio.run(scenario())
        assert latencies and max(latencies) < 2.0, max(latencies)


def test_sigterm_of_supervisor_during_traffic_leaves_no_process() -> None:
    port = free_port()
    gateway = ServerProcess(["serve", "--port", str(port), "--workers", "2"], port).start()
    try:
        pids = [w["pid"] for w in httpx.get(gateway.url + "/health").json()["workers"]]
        assert gateway.proc is not None
        gateway.proc.send_signal(signal.SIGTERM)
        assert gateway.proc.wait(timeout=15) == 0
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                _wait_exit(pid)
    finally:
        gateway.stop()


def test_unknown_command_line_values_fail_clearly() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sessiongate", "serve", "--workers", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and "--workers must be >= 0" in result.stderr


def test_idle_header_sessions_expire_but_api_sessions_do_not() -> None:
    port = free_port()
    with ServerProcess(
        ["serve", "--port", str(port), "--workers", "1", "--header-session-ttl", "0.5"], port
    ) as gateway:
        reply = httpx.post(
            gateway.url + "/v1/chat/completions",
            json={"messages": start_messages(), "max_tokens": 4},
            headers={"X-Session-ID": "bench-7"},
        )
        assert reply.status_code == 200
        api_session = httpx.post(gateway.url + "/sessions").json()["session_id"]
        assert httpx.get(gateway.url + "/sessions/bench-7").status_code == 200
        deadline = time.monotonic() + 10
        # Watched through /health: a request naming the session counts as activity.
        while httpx.get(gateway.url + "/health").json()["workers"][0]["sessions_expired"] == 0:
            assert time.monotonic() < deadline, "idle header session never expired"
            time.sleep(0.1)
        gone = httpx.get(gateway.url + "/sessions/bench-7")
        assert gone.status_code == 404
        assert gone.json()["error"] == "session bench-7 expired after 0.5 s idle"
        assert httpx.get(f"{gateway.url}/sessions/{api_session}").status_code == 200

"""`serve --workers 0`: the in-process gateway (one process, no router hop), end to end."""

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
from support.procs import ServerProcess, free_port

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs


@pytest.fixture(scope="module")
def gateway() -> Iterator[ServerProcess]:
    port = free_port()
    argv = ["serve", "--port", str(port), "--workers", "0", "--r3", "--stream-upstream", "relay"]
    # An engine with a parser streams every logprob, so streamed turns are really relayed.
    argv += ["--mock-args", "--tool-call-parser qwen25"]
    with ServerProcess(argv, port) as proc:
        yield proc


def _turn(client: httpx.Client, session_id: str, messages: list[dict[str, Any]]) -> Any:
    response = client.post(
        f"/sessions/{session_id}/v1/chat/completions",
        json={"messages": messages, "max_tokens": 16},
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-sessiongate-recorded"] == "true"
    return response.json()


def test_sessions_are_token_exact(gateway: ServerProcess) -> None:
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        for _ in range(3):
            session_id = client.post("/sessions").json()["session_id"]
            messages: list[dict[str, Any]] = [{"role": "user", "content": "Start."}]
            for turn in range(4):
                reply = _turn(client, session_id, messages)
                assert "routed_experts" not in reply["choices"][0]["meta_info"]
                messages += [
                    reply["choices"][0]["message"],
                    {"role": "tool", "content": f"result {turn}"},
                ]
            document = client.get(f"/sessions/{session_id}").json()
            assert len(document["records"]) == 4
            assert trajectory_problems(document) == []
            assert client.delete(f"/sessions/{session_id}").status_code == 204


def test_health_metrics_proxy_and_stream(gateway: ServerProcess) -> None:
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        health = client.get("/health").json()
        assert health["status"] == "ok" and health["upstreams"][0]["healthy"] is True
        stateless = client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
        )
        assert stateless.status_code == 200 and stateless.json()["choices"][0]["message"]
        session_id = client.post("/sessions").json()["session_id"]
        streamed = client.post(
            f"/sessions/{session_id}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "stream": True},
        )
        events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and len(events) > 3
        assert json.loads(events[-2])["choices"][0]["finish_reason"]
        assert len(client.get(f"/sessions/{session_id}").json()["records"]) == 1
        metrics = client.get("/metrics").text
        assert 'sessiongate_requests_total{op="proxy",status="200"} 1' in metrics
        assert 'sessiongate_worker_sessions{worker="0"}' in metrics


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"  # exited; its new parent has not reaped it yet


def test_sigterm_stops_the_gateway_and_its_mock_engine() -> None:
    port = free_port()
    with ServerProcess(["serve", "--port", str(port), "--workers", "0"], port) as gateway:
        assert gateway.proc is not None
        pid = gateway.proc.pid
        engines = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        assert engines, "the embedded mock engine is a child process"
        os.kill(pid, signal.SIGTERM)
        assert gateway.proc.wait(timeout=15) == 0
        assert all(_gone(engine) for engine in engines)


def test_in_process_excludes_ray() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sessiongate", "serve", "--workers", "0", "--ray"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "--workers 0 (in-process) and --ray exclude each other" in result.stderr


def test_a_dead_mock_engine_stops_the_gateway() -> None:
    port = free_port()
    with ServerProcess(["serve", "--port", str(port), "--workers", "0"], port) as gateway:
        assert gateway.proc is not None
        pid = gateway.proc.pid
        engine = int(Path(f"/proc/{pid}/task/{pid}/children").read_text().split()[0])
        os.kill(engine, signal.SIGKILL)
        assert gateway.proc.wait(timeout=15) == 1
        assert "exited with code -9" in gateway.output()


def test_health_answers_while_the_one_loop_receives_large_replies() -> None:
    port = free_port()
    # ~16 MiB of R3 (~21 MiB of base64) per reply, received and parsed by the same process
    # that answers /health: parses and fresh buffers run in threads, so the loop stays free.
    mock = "--r3-layers 512 --r3-topk 8 --completion-tokens 32"
    args = ["serve", "--port", str(port), "--workers", "0", "--r3", "--mock-args", mock]
    with ServerProcess(args, port) as gateway:
        prompt = [{"role": "user", "content": " ".join(["word"] * 1000)}]

        async def scenario() -> list[float]:
            async with httpx.AsyncClient(base_url=gateway.url, timeout=120) as client:
                sids = [(await client.post("/sessions")).json()["session_id"] for _ in range(6)]

                async def turn(sid: str) -> None:
                    url = f"/sessions/{sid}/v1/chat/completions"
                    messages = list(prompt)
                    for step in range(4):
                        reply = await client.post(url, json={"messages": messages})
                        assert reply.status_code == 200, reply.text
                        messages += [
                            reply.json()["choices"][0]["message"],
                            {"role": "user", "content": f"next {step}"},
                        ]

                load = asyncio.gather(*(turn(sid) for sid in sids))
                latencies: list[float] = []
                while not load.done():
                    started = time.monotonic()
                    assert (await client.get("/health")).status_code == 200
                    latencies.append(time.monotonic() - started)
                    await asyncio.sleep(0.05)
                await load
                return latencies

        latencies = asyncio.run(scenario())
        assert latencies and max(latencies) < 2.0, max(latencies)

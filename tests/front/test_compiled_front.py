"""The compiled front door end to end (`serve --front`, front/compiled.py).

Real `serve` processes in both layouts in front of the real mock engine: stateless proxy
requests are answered by the Rust server (they show in /metrics as the front's), and
everything else reaches the Python server through a connection hand-off, on the same kept
alive connection as the stateless requests before and after it.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.procs import ServerProcess, free_port, mock_engine

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
LAYOUTS = {"inprocess": ["--workers", "0"], "workers": ["--workers", "1"]}
API_KEY = "front-key"


@pytest.fixture(scope="module")
def engine() -> Iterator[ServerProcess]:
    with mock_engine() as proc:
        yield proc


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def gateway(request: pytest.FixtureRequest, engine: ServerProcess) -> Iterator[ServerProcess]:
    port = free_port()
    argv = ["serve", "--port", str(port), *LAYOUTS[request.param], "--backend", engine.url]
    with ServerProcess([*argv, "--front", "compiled"], port, timeout=60) as proc:
        yield proc


def metric(text: str, name: str) -> float:
    """The value of an unlabelled (or first labelled) sample `name`."""
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics:\n{text}")


def proxy_count(text: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith('sessiongate_requests_total{op="proxy"')
    )


def sse_events(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def test_stateless_requests_are_answered_by_the_front(gateway: ServerProcess) -> None:
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        before = client.get("/metrics").text
        reply = client.post("/v1/chat/completions", json=CHAT)
        assert reply.status_code == 200, reply.text
        assert reply.headers["content-type"].startswith("application/json")
        assert reply.json()["choices"][0]["message"]["role"] == "assistant"
        models = client.get("/v1/models")
        assert models.status_code == 200 and models.json()["data"]
        streamed = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert streamed.status_code == 200
        assert streamed.headers["content-type"].startswith("text/event-stream")
        events = sse_events(streamed.text)
        assert events[-1] == "[DONE]" and len(events) > 2
        assert json.loads(events[-2])["choices"][0]["finish_reason"]
        # An engine 4xx passes through unchanged.
        bad = client.post("/v1/chat/completions", content=b"{}", headers={"x": "y"})
        assert bad.status_code == 400, bad.text
        after = client.get("/metrics").text
    assert proxy_count(after) - proxy_count(before) == 4
    # /metrics itself is answered by Python on the front's connection, not handed off.
    assert metric(after, "sessiongate_front_handoffs_total") == 0
    assert metric(after, 'sessiongate_front_upstream_up{url="' + gateway_engine(after)) == 1


def gateway_engine(metrics: str) -> str:
    for line in metrics.splitlines():
        if line.startswith('sessiongate_front_upstream_up{url="'):
            return line.split('"')[1] + '"}'
    raise AssertionError("no sessiongate_front_upstream_up sample")


def turn(client: httpx.Client, session_id: str, messages: list[dict[str, Any]]) -> Any:
    reply = client.post(f"/sessions/{session_id}/v1/chat/completions", json={"messages": messages})
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-sessiongate-recorded"] == "true"
    return reply.json()


def test_one_connection_mixes_front_and_python_requests(gateway: ServerProcess) -> None:
    # One connection for everything: stateless requests relayed by the front, the session
    # API answered by Python, in order, with nothing lost or duplicated; a HEAD (which only
    # the Python HTTP server serves) hands the connection off and it goes on there.
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    with httpx.Client(base_url=gateway.url, timeout=30, limits=limits) as client:
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
        session_id = client.post("/sessions").json()["session_id"]
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Start."}]
        for index in range(3):
            reply = turn(client, session_id, messages)
            messages += [reply["choices"][0]["message"], {"role": "tool", "content": f"{index}"}]
            assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
        header_turn = client.post(
            "/v1/chat/completions", json=CHAT, headers={"X-Session-ID": f"h-{session_id}"}
        )
        assert header_turn.headers["x-sessiongate-recorded"] == "true"
        document = client.get(f"/sessions/{session_id}").json()
        assert len(document["records"]) == 3
        assert metric(client.get("/metrics").text, "sessiongate_front_handoffs_total") == 0
        assert client.head("/health").status_code == 200
        assert client.delete(f"/sessions/{session_id}").status_code == 204
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert metric(client.get("/metrics").text, "sessiongate_front_handoffs_total") == 1


def test_api_key_is_checked_on_the_front_path(engine: ServerProcess) -> None:
    port = free_port()
    argv = ["serve", "--port", str(port), "--workers", "0", "--backend", engine.url]
    with ServerProcess([*argv, "--api-key", API_KEY], port, timeout=60) as gw:
        missing = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30)
        assert missing.status_code == 401 and "API key" in missing.json()["error"]
        wrong = httpx.post(
            gw.url + "/v1/chat/completions",
            json=CHAT,
            headers={"Authorization": "Bearer nope"},
            timeout=30,
        )
        assert wrong.status_code == 401
        good = httpx.post(
            gw.url + "/v1/chat/completions",
            json=CHAT,
            headers={"Authorization": f"bearer {API_KEY}", "X-Probe": "front"},
            timeout=30,
        )
        assert good.status_code == 200, good.text
        seen = httpx.get(engine.url + "/mock/requests?last=1", timeout=30).json()["headers"][-1]
        # The gateway's key is not the upstream's; replies are relayed uncompressed.
        assert seen.get("x-probe") == "front" and "authorization" not in seen
        assert seen["accept-encoding"] == "identity"
        # Over the body limit: handed off before any body is read, and Python's 413.
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}"
            "\r\nContent-Length: 999999999999\r\n\r\n"
        )
        with socket.create_connection(("127.0.0.1", gw.port), timeout=30) as sock:
            sock.sendall(head.encode())
            assert sock.recv(65536).startswith(b"HTTP/1.1 413 ")


@pytest.mark.parametrize("front", ["compiled", "python"])
def test_an_unreachable_upstream_is_the_same_502_from_either_front(front: str) -> None:
    dead = free_port()
    port = free_port()
    argv = ["serve", "--port", str(port), "--workers", "0", "--front", front]
    with ServerProcess([*argv, "--backend", f"http://127.0.0.1:{dead}"], port, timeout=60) as gw:
        reply = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30)
        assert reply.status_code == 502
        assert reply.json()["error"].startswith(
            f"upstream transport error: POST http://127.0.0.1:{dead}/v1/chat/completions "
            "failed (ConnectFailed: "
        )
        metrics = httpx.get(gw.url + "/metrics", timeout=30).text
        assert ("sessiongate_front_handoffs_total" in metrics) == (front == "compiled")


def test_compiled_front_refuses_what_it_cannot_serve() -> None:
    argv = ["serve", "--port", str(free_port()), "--front", "compiled"]
    result = subprocess.run(
        [sys.executable, "-m", "sessiongate", *argv, "--backend", "https://127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "--front compiled" in result.stderr and "https://127.0.0.1:1" in result.stderr


def test_an_engine_restart_costs_only_the_requests_made_while_it_was_down() -> None:
    engine_port = free_port()
    port = free_port()
    engine_argv = ["mock-engine", "--port", str(engine_port)]
    argv = ["serve", "--port", str(port), "--workers", "1", "--front", "compiled"]
    argv += ["--backend", f"http://127.0.0.1:{engine_port}", "--health-interval", "0.5"]
    with ServerProcess(engine_argv, engine_port) as engine:
        with ServerProcess(argv, port, timeout=60) as gw, httpx.Client(base_url=gw.url) as client:
            assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
            engine.stop()
            down = client.post("/v1/chat/completions", json=CHAT)
            assert down.status_code == 502 and "ConnectFailed" in down.json()["error"]
            with ServerProcess(engine_argv, engine_port):
                # Pooled connections to the old engine are dead: the front must not reuse
                # them, and the upstream marked down is tried again (it is the only one).
                for _ in range(3):
                    again = client.post("/v1/chat/completions", json=CHAT)
                    assert again.status_code == 200, again.text
                metrics = client.get("/metrics").text
    assert 'sessiongate_requests_total{op="proxy",status="502"} 1' in metrics

"""Engines register themselves with the gateway as the rollout framework's router client
does (miles/backends/sglang_utils/sglang_engine.py `_init_normal`, `shutdown`), in both
dialects, and traffic reaches only the registered engines: real processes on loopback, in
the in-process layout (`--workers 0`) and behind the router (`--workers 1`).

The client calls `raise_for_status()` on every reply, so each call asserts a 2xx and the
body the client reads."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from urllib.parse import quote

import httpx
import pytest

from support.procs import ServerProcess, free_port, mock_engine

pytestmark = pytest.mark.procs

LAYOUTS = ["0", "1"]
GENERATE = {"text": "hello", "sampling_params": {"max_new_tokens": 4}}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@contextmanager
def gateway(workers: str, *extra: str) -> Iterator[ServerProcess]:
    port = free_port()
    args = ["serve", "--workers", workers, "--port", str(port), "--health-interval", "0.5"]
    with ServerProcess([*args, *extra], port, timeout=60.0) as server:
        yield server


def requests_of(engine: ServerProcess) -> int:
    count: int = httpx.get(engine.url + "/mock/stats").json()["requests"]
    return count


def raise_for_status(reply: httpx.Response) -> httpx.Response:
    reply.raise_for_status()  # what the framework's client does
    return reply


@pytest.mark.parametrize("workers", LAYOUTS)
def test_both_dialects_register_list_remove_and_abort(workers: str) -> None:
    with mock_engine() as old, mock_engine() as new, gateway(workers, "--backend", "none") as gw:
        client = httpx.Client(base_url=gw.url, timeout=30.0)
        assert client.get("/health").json()["status"] in ("degraded", "ok")
        # Nothing registered yet: turns and stateless requests are 503, said plainly.
        for path, body in (("/generate", GENERATE), ("/v1/chat/completions", CHAT)):
            reply = client.post(path, json=body)
            assert reply.status_code == 503, reply.text
            assert reply.json() == {"error": "no engine registered yet"}

        # The old dialect (--use-miles-router, sglang_router <= 0.2.1).
        reply = raise_for_status(client.post(f"/add_worker?url={old.url}"))
        assert reply.json()["status"] == "success" and reply.json()["url"] == old.url
        # The new one (sglang_router >= 0.3.0).
        reply = raise_for_status(
            client.post("/workers", json={"url": new.url, "worker_type": "regular"})
        )
        assert reply.status_code == 202
        document = reply.json()
        assert document["status"] == "accepted" and document["url"] == new.url
        new_id = document["worker_id"]

        assert raise_for_status(client.get("/list_workers")).json() == {"urls": [old.url, new.url]}
        listing = raise_for_status(client.get("/workers")).json()
        assert listing["total"] == 2
        assert [(w["url"], w["is_healthy"], w["state"]) for w in listing["workers"]] == [
            (old.url, True, "ready"),
            (new.url, True, "ready"),
        ]

        # The abort path: list the engines, post /abort_request to each one directly.
        for url in client.get("/list_workers").json()["urls"]:
            raise_for_status(
                httpx.post(url.split("@")[0] + "/abort_request", json={"abort_all": True})
            )

        # Traffic reaches the registered engines only.
        for _ in range(4):
            raise_for_status(client.post("/generate", json=GENERATE))
        assert requests_of(old) + requests_of(new) == 4

        # Removal: the old dialect, the new by id, and 0.2.2-0.2.x's DELETE by URL.
        raise_for_status(client.post(f"/remove_worker?url={old.url}"))
        assert client.get("/list_workers").json() == {"urls": [new.url]}
        raise_for_status(client.delete(f"/workers/{new_id}"))
        assert client.get("/workers").json()["total"] == 0
        raise_for_status(client.post("/workers", json={"url": new.url}))
        raise_for_status(client.delete("/workers/" + quote(new.url, safe="")))
        assert client.get("/list_workers").json() == {"urls": []}
        assert client.post("/generate", json=GENERATE).status_code == 503

        # Unknown engines are 404.
        assert client.delete("/workers/engine-000000000000").status_code == 404
        assert client.post(f"/remove_worker?url={old.url}").status_code == 404


@pytest.mark.parametrize("workers", LAYOUTS)
def test_refusals_are_clear_400s(workers: str) -> None:
    with mock_engine() as engine, gateway(workers, "--backend", "none") as gw:
        client = httpx.Client(base_url=gw.url, timeout=30.0)
        for body, named in (
            ({"url": engine.url, "worker_type": "prefill", "bootstrap_port": 8998}, "prefill"),
            ({"url": engine.url, "worker_type": "decode"}, "decode"),
            ({"url": engine.url, "bootstrap_port": 8998}, "bootstrap_port"),
            ({"url": engine.url, "worker_type": "weird"}, "weird"),
            ({"worker_type": "regular"}, "url"),
            ({"url": "ftp://x:1"}, "http"),
            ({"url": 5}, "url"),
        ):
            reply = client.post("/workers", json=body)
            assert reply.status_code == 400, (body, reply.text)
            assert named in reply.json()["error"], (body, reply.text)
        for content in (b"{", b"[]"):
            reply = client.post("/workers", content=content)
            assert reply.status_code == 400 and "error" in reply.json()
        assert client.post("/add_worker").status_code == 400
        assert client.post("/add_worker?url=not-a-url").status_code == 400
        assert client.put("/workers", json={"url": engine.url}).status_code == 405
        assert client.get("/list_workers").json() == {"urls": []}


@pytest.mark.parametrize("workers", LAYOUTS)
def test_registered_engine_replaces_the_mock_and_wrong_urls_never_serve(workers: str) -> None:
    # No --backend: the embedded mock stands in until the first registration.
    with mock_engine() as engine, gateway(workers, "--front", "python") as gw:
        client = httpx.Client(base_url=gw.url, timeout=30.0)
        assert client.get("/list_workers").json() == {"urls": []}
        raise_for_status(client.post("/workers", json={"url": "http://127.0.0.1:1"}))
        raise_for_status(client.post("/workers", json={"url": engine.url}))
        listing = {w["url"]: w for w in client.get("/workers").json()["workers"]}
        assert listing["http://127.0.0.1:1"]["state"].startswith("unreachable: ")
        assert listing["http://127.0.0.1:1"]["is_healthy"] is False
        assert listing[engine.url]["state"] == "ready"
        for _ in range(3):
            raise_for_status(client.post("/generate", json=GENERATE))
        # A session turn too.
        session = client.post("/sessions").json()["session_id"]
        raise_for_status(client.post(f"/sessions/{session}/v1/chat/completions", json=CHAT))
        assert requests_of(engine) == 4  # every request, none to the mock or the bad URL


@pytest.mark.parametrize("workers", LAYOUTS)
def test_removed_under_load_finishes_in_flight_and_moves_new_requests(workers: str) -> None:
    slow = ("--token-delay-ms", "300")
    with ExitStack() as stack:
        first = stack.enter_context(mock_engine(*slow))
        second = stack.enter_context(mock_engine())
        gw = stack.enter_context(gateway(workers, "--backend", "none"))
        client = httpx.Client(base_url=gw.url, timeout=60.0)
        raise_for_status(client.post(f"/add_worker?url={first.url}"))
        results: list[httpx.Response] = []
        body = {"text": "slow", "sampling_params": {"max_new_tokens": 8}}
        thread = threading.Thread(
            target=lambda: results.append(client.post("/generate", json=body))
        )
        thread.start()
        while httpx.get(first.url + "/mock/stats").json()["in_flight"] == 0:
            time.sleep(0.02)
        raise_for_status(client.post(f"/add_worker?url={second.url}"))
        raise_for_status(client.post(f"/remove_worker?url={first.url}"))
        for _ in range(3):
            raise_for_status(client.post("/generate", json=GENERATE))
        thread.join(timeout=60)
        assert results and results[0].status_code == 200, results
        assert len(results[0].json()["output_ids"]) == 8
        assert requests_of(first) == 1 and requests_of(second) == 3


def test_restarted_worker_keeps_the_registered_set() -> None:
    with mock_engine() as engine, gateway("1", "--backend", "none") as gw:
        client = httpx.Client(base_url=gw.url, timeout=30.0)
        raise_for_status(client.post("/workers", json={"url": engine.url}))
        raise_for_status(client.post("/generate", json=GENERATE))
        pid = client.get("/health").json()["workers"][0]["pid"]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            worker = client.get("/health").json()["workers"][0]
            if worker["pid"] not in (None, pid) and worker["state"] == "up":
                break
            time.sleep(0.1)
        else:
            pytest.fail("the worker did not come back")
        # Its pool started from `--backend none`; the router gave it the registered set.
        deadline = time.monotonic() + 30
        while client.post("/generate", json=GENERATE).status_code != 200:
            assert time.monotonic() < deadline, "the restarted worker never got the engine set"
            time.sleep(0.1)
        assert client.get("/list_workers").json() == {"urls": [engine.url]}
        session = client.post("/sessions").json()["session_id"]
        raise_for_status(client.post(f"/sessions/{session}/v1/chat/completions", json=CHAT))


def front_engines(client: httpx.Client) -> dict[str, str]:
    """The compiled front's own engines and their state, from /metrics."""
    found = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("sessiongate_front_upstream_up{"):
            labels, value = line.rsplit(" ", 1)
            found[labels.split('url="', 1)[1].rstrip('"}')] = value
    return found


@pytest.mark.parametrize("workers", LAYOUTS)
def test_compiled_front_relays_to_the_registered_set(workers: str) -> None:
    """The front swaps its pool on each change of the engine set (its own engine list, in
    /metrics, follows the registry): the registered engine serves stateless requests, the
    removed one gets none, and an empty set goes to Python (a clear 503)."""
    with mock_engine() as static, mock_engine() as registered:
        with gateway(workers, "--backend", static.url, "--front", "compiled") as gw:
            client = httpx.Client(base_url=gw.url, timeout=30.0)
            raise_for_status(client.post("/generate", json=GENERATE))
            assert requests_of(static) == 1  # static --backend works as before
            assert front_engines(client) == {static.url: "1"}
            raise_for_status(client.post(f"/add_worker?url={registered.url}"))
            raise_for_status(client.post(f"/remove_worker?url={static.url}"))
            assert front_engines(client) == {registered.url: "1"}
            for _ in range(3):
                raise_for_status(client.post("/generate", json=GENERATE))
                raise_for_status(client.post("/v1/chat/completions", json=CHAT))
            assert requests_of(static) == 1 and requests_of(registered) == 6
            raise_for_status(client.post(f"/remove_worker?url={registered.url}"))
            reply = client.post("/generate", json=GENERATE)
            assert reply.status_code == 503, reply.text
            assert "no engine" in reply.text


def test_admin_key_guards_management_only() -> None:
    with mock_engine() as engine:
        extra = ("--backend", "none", "--api-key", "client", "--admin-key", "admin")
        with gateway("0", *extra) as gw:
            client = httpx.Client(base_url=gw.url, timeout=30.0)
            body = {"url": engine.url}
            assert client.post("/workers", json=body).status_code == 401
            client_key = {"authorization": "Bearer client"}
            assert client.post("/workers", json=body, headers=client_key).status_code == 401
            admin = {"authorization": "Bearer admin"}
            raise_for_status(client.post("/workers", json=body, headers=admin))
            assert client.post("/generate", json=GENERATE, headers=admin).status_code == 401
            raise_for_status(client.post("/generate", json=GENERATE, headers=client_key))

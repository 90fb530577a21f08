"""The RL control plane's pieces (rl/plane.py) against real HTTP stand-ins on loopback: engine
paths, rows, what the registry learns from the calls that pass through (a refused pause
releases the engine, a timed-out one keeps it held, a weight update is read back from the
engine), and a client that leaves cancelling its call (a real `serve`)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from sessiongate.config.rl import RlConfig
from sessiongate.engines.registry import EngineRegistry
from sessiongate.protocol import CoreRequest, Op
from sessiongate.rl.plane import PlaneError, RlPlane, engine_path, selector_fields, worker_row
from support.http_stub import LoopbackServer, QuietJsonHandler, serving
from support.procs import ServerProcess, free_port


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        ("", "path is empty"),
        ("a//b", "path has an empty segment"),
        ("a/", "path has an empty segment"),
        ("a/../b", "must not contain `.` or `..` segments"),
        ("%2e%2E", "must not contain `.` or `..` segments"),
        ("a/b/c/d/e", "more than 4 segments"),
    ],
)
def test_engine_paths_are_checked_as_smg_checks_them(raw: str, why: str) -> None:
    with pytest.raises(PlaneError) as refused:
        engine_path(raw)
    assert refused.value.status == 400 and refused.value.document["error"] == "invalid_engine_path"
    assert why in str(refused.value.document["message"])


def test_good_engine_paths_pass_as_given() -> None:
    assert engine_path("pause_generation") == "/pause_generation"
    assert engine_path("a/b/c/d") == "/a/b/c/d"
    assert engine_path("v1/loads") == "/v1/loads"


def test_rows_take_info_labels_then_the_engines_own_and_smgs_keys_win() -> None:
    registry = EngineRegistry(["http://e:1"], labels=("role=actor", "engine=vllm"))
    (engine,) = registry.listing()
    engine.server_info = {"version": "0.5.23", "tp_size": 2}
    engine.model_info = {"model_path": "/m", "served_model_name": "qwen", "is_generation": True}
    engine.weight_version = "7"
    row = worker_row(engine)
    assert row["engine_version"] == "0.5.23" and row["tp_size"] == 2 and row["model_id"] == "qwen"
    assert row["labels"] == {
        "version": "0.5.23",
        "served_model_name": "qwen",
        "model_path": "/m",
        "weight_version": "7",
        "is_generation": "true",
        "role": "actor",
        "engine": "vllm",
    }
    assert row["role"] == "actor" and row["health"] == "ready"
    fields = selector_fields(row)
    assert fields["engine"] == "sglang" and fields["model"] == "qwen"  # smg's keys win


class Stand(LoopbackServer):
    """An engine's control routes: `answers[path] = (status, JSON body)`; every request
    recorded as (method, path, body)."""

    def __init__(self, answers: dict[str, tuple[int, object]]) -> None:
        self.answers = answers
        self.seen: list[tuple[str, str, Any]] = []
        self.hang: set[str] = set()
        super().__init__(_StandHandler)


class _StandHandler(QuietJsonHandler):
    server: Stand

    def _answer(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.server.seen.append((self.command, self.path, body))
        if self.path in self.server.hang:
            time.sleep(3)
        status, document = self.server.answers.get(self.path, (404, {"detail": "Not Found"}))
        self.send_json(json.dumps(document).encode(), status)

    do_GET = do_POST = _answer


@pytest.fixture
def stand() -> Iterator[Stand]:
    server = Stand(
        {
            "/health": (200, {}),
            "/model_info": (200, {"model_path": "m", "weight_version": "v1"}),
            "/pause_generation": (200, {"message": "Generation paused successfully."}),
            "/continue_generation": (200, {"message": "Generation continued successfully."}),
        }
    )
    with serving(server):
        yield server


def call(path: str, body: object, query: str = "") -> CoreRequest:
    raw = json.dumps(body).encode()
    return CoreRequest(
        op=Op.RL,
        path=path,
        method="POST",
        query=query,
        headers=[("content-type", "application/json")],
        body=raw,
    )


def test_pause_continue_and_weight_updates_are_learned(stand: Stand) -> None:
    async def scenario() -> None:
        registry = EngineRegistry([stand.url])
        plane = RlPlane(registry, RlConfig(enable_rl=True, control_timeout_secs=1))
        (engine,) = registry.listing()
        base = f"/v1/rl/workers/{engine.id}/engine"
        reply = await plane.handle(call(f"{base}/pause_generation", {"mode": "in_place"}))
        assert reply.status == 200 and engine.paused == "in_place"
        assert registry.held() == [stand.url]
        reply = await plane.handle(call(f"{base}/continue_generation", {}))
        assert reply.status == 200 and engine.paused is None and registry.held() == []
        # A pause the engine refuses (SGLang's 422 for a bad mode) leaves it unpaused.
        stand.answers["/pause_generation"] = (422, {"detail": "bad mode"})
        reply = await plane.handle(call(f"{base}/pause_generation", {"mode": "nope"}))
        assert reply.status == 422 and engine.paused is None
        # A pause that times out may have paused it: held until its /ready says otherwise.
        stand.answers["/pause_generation"] = (200, {})
        stand.hang.add("/pause_generation")
        reply = await plane.handle(call(f"{base}/pause_generation", {}))
        assert reply.status == 504 and json.loads(reply.body)["error"] == "upstream_timeout"
        assert engine.paused == "abort"
        stand.hang.clear()
        await registry.resume(engine)
        # A weight update: the version is read back from the engine's model info.
        stand.answers["/update_weight_version"] = (200, {"success": True})
        stand.answers["/model_info"] = (200, {"model_path": "m", "weight_version": "v2"})
        reply = await plane.handle(call(f"{base}/update_weight_version", {"new_version": "x"}))
        assert reply.status == 200 and engine.weight_version == "v2"
        assert registry.newest_version == "v2"
        # A failed one changes nothing.
        stand.answers["/update_weights_from_disk"] = (400, {"success": False})
        body = {"model_path": "/nope", "weight_version": "v3"}
        await plane.handle(call(f"{base}/update_weights_from_disk", body))
        assert engine.weight_version == "v2"
        # The engine saw each call as sent.
        sent = [(m, p, b) for m, p, b in stand.seen if p != "/model_info"]
        assert sent[0] == ("POST", "/pause_generation", {"mode": "in_place"})

    asyncio.run(scenario())


def test_the_plane_is_off_without_enable_rl(stand: Stand) -> None:
    async def scenario() -> None:
        plane = RlPlane(EngineRegistry([stand.url]), RlConfig())
        reply = await plane.handle(CoreRequest(op=Op.RL, path="/v1/rl/workers", method="GET"))
        assert reply.status == 404 and b"--enable-rl" in reply.body
        assert not stand.seen

    asyncio.run(scenario())


class Silent:
    """A port that accepts connections and never answers; `closed` is set when a control
    call's connection (not a probe's) is closed by the gateway."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.opened = 0
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.opened += 1
            threading.Thread(target=self._drain, args=(conn,), daemon=True).start()

    def _drain(self, conn: socket.socket) -> None:
        with conn:
            first = conn.recv(65536)
            while conn.recv(65536):
                pass
        if first.startswith(b"POST /pause_generation"):  # not one of the registry's probes
            self.closed.set()


@pytest.mark.procs
@pytest.mark.parametrize("front", ["compiled", "python"])
def test_a_client_that_leaves_cancels_its_control_call(front: str) -> None:
    silent = Silent()
    port = free_port()
    argv = ["serve", "--port", str(port), "--workers", "0", "--front", front, "--enable-rl"]
    with ServerProcess(argv, port, timeout=60) as gateway:
        # Registered although it never answers its probe: listed, and callable.
        httpx.post(f"{gateway.url}/workers", json={"url": silent.url}, timeout=30)
        rows = httpx.get(f"{gateway.url}/v1/rl/workers").json()["workers"]
        (silent_id,) = [r["id"] for r in rows if r["url"] == silent.url]
        probes = silent.opened
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{gateway.url}/v1/rl/workers/{silent_id}/engine/pause_generation",
                json={},
                timeout=1.0,
            )
        # The gateway's call (600 s allowed) is dropped once the client is gone.
        assert silent.closed.wait(10), "the control call outlived its client"
        assert silent.opened > probes
    silent.sock.close()

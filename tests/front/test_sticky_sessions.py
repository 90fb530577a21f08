"""--sticky-sessions end to end: smg's key rules through the compiled front (its Rust policy)
and the Python front (the in-process pool, or a worker's), over round robin so that every
placement without a pin is known in advance.

The engines are stubs that count posts and hold a request whose prompt says "hold" until the
test releases it, so the requests a key has in flight are known.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from support.http_stub import CHAT_COMPLETION, LoopbackServer, QuietJsonHandler, serving
from support.procs import ServerProcess, free_port

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

LAYOUTS = [("compiled", "0"), ("python", "0"), ("python", "1"), ("python", "2")]


class StubEngine(LoopbackServer):
    def __init__(self, name: str) -> None:
        self.name = name
        self.rids: list[str | None] = []
        self.release = threading.Event()
        self.held = threading.Semaphore(0)
        super().__init__(_Handler)


class _Handler(QuietJsonHandler):
    server: StubEngine

    def do_GET(self) -> None:
        self.send_json(b"{}")

    def do_POST(self) -> None:
        doc = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)))
        with self.server.lock:
            self.server.rids.append(doc.get("rid"))
        if "hold" in json.dumps(doc.get("messages")):
            self.server.held.release()
            self.server.release.wait(30)
        self.send_json(CHAT_COMPLETION)


@contextlib.contextmanager
def gateway(front: str, layout: str, *extra: str) -> Any:
    with serving(StubEngine("a")) as a, serving(StubEngine("b")) as b:
        try:
            port = free_port()
            argv = ["serve", "--port", str(port), "--workers", layout, "--front", front]
            argv += ["--backend", a.url, "--backend", b.url, "--policy", "round_robin"]
            argv += ["--sticky-sessions", *extra]
            with ServerProcess(argv, port, timeout=60) as gw:
                yield gw, {a.name: a, b.name: b}
        finally:
            a.release.set()
            b.release.set()


def ask(gw: ServerProcess, rid: str | None, text: str = "q", **headers: str) -> None:
    body: dict[str, object] = {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
    if rid is not None:
        body["rid"] = rid
    reply = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
    assert reply.status_code == 200, reply.text


def where(engines: dict[str, StubEngine], rid: str) -> list[str]:
    return [name for name, e in engines.items() for r in e.rids if r == rid]


@pytest.mark.parametrize(("front", "layout"), LAYOUTS)
def test_a_conversation_stays_and_spills_past_two_in_flight(front: str, layout: str) -> None:
    with gateway(front, layout) as (gw, engines):
        # Round robin would alternate; every turn and retry of `conv` stays where it began.
        for rid in ("conv_t1", "conv_t2", "conv_t2_r1", "conv_t3", "conv"):
            ask(gw, rid)
        home = where(engines, "conv_t1")[0]
        for rid in ("conv_t2", "conv_t2_r1", "conv_t3", "conv"):
            assert where(engines, rid) == [home], rid
        other = next(name for name in engines if name != home)
        # Two of the key's requests held on its engine: the third goes where round robin
        # picks (the other engine, as only new keys and spills advance it), and the pin
        # follows it there.
        with ThreadPoolExecutor(2) as pool:
            held = [pool.submit(ask, gw, f"conv_t{4 + i}", "hold") for i in range(2)]
            for _ in held:
                assert engines[home].held.acquire(timeout=20)
            ask(gw, "conv_t6")
            engines[home].release.set()
            for future in held:
                future.result(timeout=30)
        assert where(engines, "conv_t6") == [other]
        ask(gw, "conv_t7")
        assert where(engines, "conv_t7") == [other]


@pytest.mark.parametrize(("front", "layout"), LAYOUTS)
def test_a_header_key_without_a_rid_and_idle_keys_forgotten(front: str, layout: str) -> None:
    extra = ["--routing-key-headers", "X-Session", "--sticky-key-idle-secs", "1"]
    with gateway(front, layout, *extra, "--eviction-interval-secs", "1") as (gw, engines):
        for turn in range(4):
            ask(gw, None, f"t{turn}", **{"X-Session": f"agent7_t{turn}"})
        counts = {name: len(e.rids) for name, e in engines.items()}
        assert sorted(counts.values()) == [0, 4], counts  # one engine took all four
        home = max(counts, key=lambda name: counts[name])
        # Unused past --sticky-key-idle-secs: forgotten at a trim; round robin (advanced
        # once, by the key's first request) places it on the other engine now.
        time.sleep(3.0)
        ask(gw, None, "again", **{"X-Session": "agent7"})
        assert len(engines[home].rids) == 4


@pytest.mark.parametrize(("front", "layout"), [("compiled", "0"), ("python", "2")])
def test_hostile_keys_are_no_keys_and_lose_nothing(front: str, layout: str) -> None:
    extra = ["--routing-key-headers", "X-Session"]
    with gateway(front, layout, *extra) as (gw, engines):
        # Not UTF-8, over 128 bytes, a rid that is no string, a body that is no JSON: each is
        # served as the policy's (round robin), none refused.
        for headers, body in [
            ({"X-Session": b"\xff\xfe"}, {"messages": [{"role": "user", "content": "a"}]}),
            ({"X-Session": "k" * 129}, {"messages": [{"role": "user", "content": "b"}]}),
            ({}, {"rid": ["conv"], "messages": [{"role": "user", "content": "c"}]}),
            ({}, {"rid": 7, "messages": [{"role": "user", "content": "d"}]}),
        ]:
            reply = httpx.post(
                gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=30
            )
            assert reply.status_code == 200, reply.text
        assert sorted(len(e.rids) for e in engines.values()) == [2, 2]
        # A body that is no JSON has no rid: relayed as sent (the stub engine then fails on
        # it, a 502), and the gateway goes on serving keyed requests.
        broken = httpx.post(
            gw.url + "/v1/chat/completions",
            content=b'{"rid": "conv", "messages": [',
            headers={"content-type": "application/json"},
            timeout=30,
        )
        assert broken.status_code == 502, broken.text
        ask(gw, "conv_t1")
        ask(gw, "conv_t2")
        assert len(set(where(engines, "conv_t1") + where(engines, "conv_t2"))) == 1

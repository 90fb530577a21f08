"""X-SMG-Routing-Key in the two places sessiongate stands (docs/routing.md, "Routing keys"):
in front of plain clients, where a chat completion carrying it is a TITO session of that id;
and behind the rollout framework's session server (`--session-header none`), which does TITO
itself and stamps the header on every call: then nothing is recorded twice, the bodies reach
the engines as sent, and the key keeps one session's calls (and a rollout's /generate calls)
on one engine under the `manual` policy the framework chooses, with several workers too.
The real CLI in front of recording engines (`RawEngine` relaying to mock engine processes)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import httpx
import pytest

from sessiongate.protocol import RECORDED_HEADER
from support.procs import ServerProcess, free_port
from support.raw_engine import RawEngine, recording_engine

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

CHAT = "/v1/chat/completions"
DEADLINE = 30.0  # for something that happens at once; never a measurement


@contextmanager
def engines(count: int) -> Iterator[list[RawEngine]]:
    with ExitStack() as stack:
        yield [stack.enter_context(recording_engine()) for _ in range(count)]


@contextmanager
def gateway(*argv: str) -> Iterator[httpx.Client]:
    port = free_port()
    args = ["serve", "--port", str(port), "--health-interval", "0.5", *argv]
    with (
        ServerProcess(args, port, timeout=60.0) as server,
        httpx.Client(base_url=server.url, timeout=60.0) as client,
    ):
        yield client


def key_of(engine: RawEngine, path: str) -> list[str]:
    return [dict(a.headers).get("x-smg-routing-key", "") for a in engine.to(path)]


def test_in_front_of_plain_clients_the_header_names_a_tito_session() -> None:
    with engines(2) as (a, b), gateway("--backend", a.url, "--backend", b.url) as client:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        for _ in range(2):
            reply = client.post(CHAT, json=body, headers={"X-SMG-Routing-Key": "plain-1"})
            assert reply.status_code == 200, reply.text
            assert reply.headers[RECORDED_HEADER] == "true"
            body["messages"] += [
                reply.json()["choices"][0]["message"],
                {"role": "user", "content": "more"},
            ]
        session = client.get("/sessions/plain-1")
        assert session.status_code == 200, session.text
        # Both turns on the family's engine, tokenized by the gateway (TITO).
        arrived = a.to(CHAT) + b.to(CHAT)
        assert sorted([len(a.to(CHAT)), len(b.to(CHAT))]) == [0, 2]
        assert all("input_ids" in json.loads(x.body) for x in arrived)


def framework_chat(session: str, turn: int) -> bytes:
    """A chat call as the framework's session server sends it: TITO done (input_ids), its
    own fields set (miles/rollout/session/core.py `prepare_chat_request`)."""
    document = {
        "model": "m",
        "messages": [{"role": "user", "content": f"{session} turn {turn}"}],
        "input_ids": [101, 7, 8, 9, turn],
        "logprobs": True,
        "return_meta_info": True,
        "no_stop_trim": False,
        "max_tokens": 4,
    }
    return json.dumps(document).encode()


GENERATE = json.dumps({"input_ids": [101, 5, 6], "sampling_params": {"max_new_tokens": 4}})
BEHIND = ["--session-header", "none", "--policy", "manual", "--assignment-mode", "min_load"]
LAYOUTS = {
    # The framework's recipe: engines register; the Python front; workers relay stateless
    # calls, so a key must reach one worker (its manual policy remembers the key).
    "registered engines, 2 workers": ("--backend", "none", "--workers", "2"),
    # Static engines: the compiled front relays stateless calls with the router's policy.
    "static engines, 2 workers": ("--workers", "2"),
}


def wait_until_every_worker_has(client: httpx.Client, urls: list[str]) -> None:
    deadline = time.monotonic() + DEADLINE
    while True:
        workers = client.get("/health").json().get("workers", [])
        if workers and all(
            sorted(s["url"] for s in w.get("upstreams", [])) == sorted(urls) for w in workers
        ):
            return
        assert time.monotonic() < deadline, "the workers never got the engine set"
        time.sleep(0.05)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_behind_the_framework_session_server_the_header_is_an_engine_affinity_key(
    layout: str,
) -> None:
    with engines(2) as (a, b):
        extra = list(LAYOUTS[layout])
        if "none" not in extra:
            extra += ["--backend", a.url, "--backend", b.url]
        with gateway(*BEHIND, *extra) as client:
            if "none" in extra:
                for engine in (a, b):
                    reply = client.post("/workers", json={"url": engine.url})
                    assert reply.status_code == 202, reply.text
                wait_until_every_worker_has(client, [a.url, b.url])
            sessions = [f"framework-session-{n}" for n in range(8)]
            sent: dict[bytes, str] = {}
            for turn in range(3):
                for n, session in enumerate(sessions):
                    body = framework_chat(session, turn)
                    sent[body] = session
                    # The session server forwards the agent's headers: X-Session-ID included.
                    headers = {
                        "X-SMG-Routing-Key": session,
                        "X-Session-ID": f"agent-{session}",
                        "content-type": "application/json",
                    }
                    reply = client.post(CHAT, content=body, headers=headers)
                    assert reply.status_code == 200, reply.text
                    assert RECORDED_HEADER not in reply.headers
                    if (turn + n) % 2:
                        # Not after every call: a worker taking stateless calls in turn must
                        # not meet each key on one worker by the parity of the sequence.
                        continue
                    rollout = client.post(
                        "/generate",
                        content=GENERATE,
                        headers={"X-SMG-Routing-Key": f"rollout-{session}"},
                    )
                    assert rollout.status_code == 200, rollout.text
            # Nothing recorded a second time: no session of either id exists.
            for session in sessions[:2]:
                assert client.get(f"/sessions/{session}").status_code == 404
                assert client.get(f"/sessions/agent-{session}").status_code == 404
            # The bodies reached the engines as the session server sent them.
            arrived = a.to(CHAT) + b.to(CHAT)
            assert sorted(x.body for x in arrived) == sorted(sent)
            # One key, one engine (for the chat calls and for /generate alike).
            for path, prefix in ((CHAT, ""), ("/generate", "rollout-")):
                on_a, on_b = set(key_of(a, path)), set(key_of(b, path))
                assert on_a | on_b == {prefix + s for s in sessions}
                assert not on_a & on_b, f"{path}: keys on both engines: {on_a & on_b}"
            # min_load spreads new keys: both engines have some.
            assert a.to(CHAT) and b.to(CHAT)

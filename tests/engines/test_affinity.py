"""Session-tree affinity over several upstreams: trees stay put, a stopped upstream re-pins
only its own trees, and the turn is retried there."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest

from sessiongate.engines.pool import rendezvous_order
from support.procs import ServerProcess, free_port

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs


@pytest.fixture()
def engines() -> Iterator[list[ServerProcess]]:
    with ExitStack() as stack:
        procs = []
        for seed in range(3):
            port = free_port()
            procs.append(
                stack.enter_context(
                    ServerProcess(["mock-engine", "--port", str(port), "--seed", str(seed)], port)
                )
            )
        yield procs


def seen_by(engine: ServerProcess) -> set[str]:
    requests = httpx.get(engine.url + "/mock/requests", params={"last": 256}).json()["requests"]
    tags = set()
    for body in requests:
        for message in body.get("messages", []):
            match = re.fullmatch(r"tree (\S+)", str(message.get("content")))
            if match:
                tags.add(match.group(1))
    return tags


def test_trees_stay_on_their_upstream_and_repin_only_when_it_stops(
    engines: list[ServerProcess],
) -> None:
    port = free_port()
    args = ["serve", "--port", str(port), "--workers", "2", "--health-interval", "0.5"]
    args += ["--policy", "round_robin"]  # rendezvous placement (cache_aware places by cost)
    for engine in engines:
        args += ["--backend", engine.url]
    urls = [e.url for e in engines]
    with ServerProcess(args, port) as gateway:

        async def turns(
            client: httpx.AsyncClient, sessions: dict[str, str], history: dict[str, list]
        ) -> None:
            async def one(tag: str, sid: str) -> None:
                reply = await client.post(
                    f"/sessions/{sid}/v1/chat/completions",
                    json={"messages": history[tag], "max_tokens": 4},
                )
                assert reply.status_code == 200, reply.text
                history[tag].append(reply.json()["choices"][0]["message"])
                history[tag].append({"role": "user", "content": "more"})

            await asyncio.gather(*(one(tag, sid) for tag, sid in sessions.items()))

        async def scenario() -> None:
            async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
                sessions: dict[str, str] = {}
                history: dict[str, list] = {}
                for n in range(100):
                    sid = (await client.post("/sessions")).json()["session_id"]
                    sessions[f"s{n}"] = sid
                    history[f"s{n}"] = [{"role": "user", "content": f"tree s{n}"}]
                await turns(client, sessions, history)
                first = [seen_by(e) for e in engines]
                assert sum(map(len, first)) == 100, "every tree on exactly one upstream"
                assert all(first), "100 trees should use all three upstreams"
                for tag, sid in sessions.items():
                    expected = rendezvous_order(sid, urls)[0]
                    assert tag in first[expected]

                await turns(client, sessions, history)
                assert [seen_by(e) for e in engines] == first, "second turns stayed put"

                engines[0].stop()
                await turns(client, sessions, history)
                later = [seen_by(e) for e in engines[1:]]
                moved = later[0] - first[1] | later[1] - first[2]
                assert moved == first[0], "only the stopped upstream's trees moved"
                for tag in first[0]:
                    # Re-pinned to the tree's next rendezvous choice.
                    order = rendezvous_order(sessions[tag], urls)
                    assert tag in later[order[1] - 1]
                # Workers report their counters in heartbeats (every 0.5 s).
                repins = 0
                for _ in range(40):
                    metrics = (await client.get("/metrics")).text
                    counts = re.findall(r"sessiongate_upstream_repins_total\S* (\d+)", metrics)
                    repins = sum(int(v) for v in counts)
                    if repins >= len(first[0]):
                        break
                    await asyncio.sleep(0.1)
                assert repins >= len(first[0])

        asyncio.run(scenario())

"""Session families are placed by the engine routing policy (`--policy`), then pinned for
their life, and re-placed by the policy when their engine goes down: the real CLI with its
worker processes, in front of recording engines (each a `RawEngine` relaying to a mock engine
process), which say which engine got which session's turns (the turn's X-SMG-Routing-Key).

Root ids are chosen so that rendezvous hashing would have put the family elsewhere: a pass
shows the policy placed it, not the hash."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import httpx
import pytest

from sessiongate.engines.pool import rendezvous_order
from support.procs import ServerProcess, free_port
from support.raw_engine import RawEngine, recording_engine

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

CHAT = "/v1/chat/completions"
# Generous: a deadline for something that happens at once, never a measurement.
DEADLINE = 30.0


@contextmanager
def engines(count: int) -> Iterator[list[RawEngine]]:
    with ExitStack() as stack:
        yield [stack.enter_context(recording_engine()) for _ in range(count)]


@contextmanager
def gateway(urls: list[str], *extra: str) -> Iterator[httpx.Client]:
    port = free_port()
    argv = ["serve", "--port", str(port), "--health-interval", "0.5", *extra]
    for url in urls:
        argv += ["--backend", url]
    with (
        ServerProcess(argv, port, timeout=60.0) as server,
        httpx.Client(base_url=server.url, timeout=60.0) as client,
    ):
        yield client


def keys(engine: RawEngine) -> list[str]:
    """The sessions whose turns reached `engine`, in arrival order."""
    return [dict(a.headers)["x-smg-routing-key"] for a in engine.to(CHAT)]


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.02)


def root_not_on(index: int, urls: list[str], tag: str) -> str:
    """A root id whose rendezvous choice is not engine `index`."""
    n = 0
    while rendezvous_order(f"{tag}-{n}", urls)[0] == index:
        n += 1
    return f"{tag}-{n}"


def messages(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def turn(client: httpx.Client, session: str, text: str = "hello", *, path: bool = False) -> None:
    """One turn: a root named by its header, or (`path`) any session by its path."""
    body = {"messages": messages(text), "max_tokens": 4}
    if path:
        reply = client.post(f"/sessions/{session}{CHAT}", json=body)
    else:
        reply = client.post(CHAT, json=body, headers={"X-Session-ID": session})
    assert reply.status_code == 200, reply.text


class Held:
    """A turn sent on a thread, held in flight by its engine's closed gate."""

    def __init__(self, client: httpx.Client, session: str, *, path: bool = False) -> None:
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(client, session, path))
        self.thread.start()

    def _run(self, client: httpx.Client, session: str, path: bool) -> None:
        try:
            turn(client, session, path=path)
        except BaseException as exc:  # reported by join
            self.error = exc

    def join(self) -> None:
        self.thread.join(DEADLINE)
        assert not self.thread.is_alive() and self.error is None, self.error


def child_of(client: httpx.Client, parent: str) -> str:
    reply = client.post("/sessions", json={"parent_session_id": parent})
    assert reply.status_code == 200, reply.text
    child: str = reply.json()["session_id"]
    return child


def engine_down(client: httpx.Client, url: str) -> bool:
    """Whether the process placing families (in-process, or each worker) sees `url` down."""
    health = client.get("/health").json()
    views = [w["upstreams"] for w in health["workers"]] if "workers" in health else []
    views = views or [health["upstreams"]]
    return all(any(s["url"] == url and not s["healthy"] for s in view) for view in views)


@pytest.mark.parametrize("workers", ["0", "1"])
def test_least_in_flight_places_families_on_idle_engines_pins_them_and_replaces_them(
    workers: str,
) -> None:
    with engines(3) as (a, b, c):
        urls = [a.url, b.url, c.url]
        with gateway(urls, "--policy", "least_in_flight", "--workers", workers) as client:
            root = root_not_on(0, urls, "root")
            other = root_not_on(1, urls, "other")
            late = root_not_on(1, urls, "late")

            # Placed by load: `root` goes to a (all idle: the lowest index) and is held there,
            # so `other`, started meanwhile, lands on b.
            a.gate.clear()
            held = Held(client, root)
            wait_for(lambda: keys(a) == [root], "root's first turn reached a")
            turn(client, other)
            assert keys(b) == [other]
            a.gate.set()
            held.join()

            # Pinned for life: root's next turn and its child's first go to a while a is the
            # busiest engine; a family started then goes to an idle one.
            a.gate.clear()
            held_root = Held(client, root)
            wait_for(lambda: len(keys(a)) == 2, "root's second turn reached a")
            child = child_of(client, root)
            held_child = Held(client, child, path=True)
            wait_for(lambda: len(keys(a)) == 3, "the child's turn reached a")
            turn(client, late)
            a.gate.set()
            held_root.join()
            held_child.join()
            assert keys(a) == [root, root, child]
            assert keys(b) == [other, late]
            assert keys(c) == []

            # a goes down: its family is re-placed by the policy among the others; b is busy
            # (a turn held there), so root and its child move to c, and stay with each other.
            a.stop()
            wait_for(lambda: engine_down(client, a.url), "the gateway saw a down")
            b.gate.clear()
            held = Held(client, other)
            wait_for(lambda: len(keys(b)) == 3, "other's turn reached b")
            turn(client, root)
            turn(client, child, path=True)
            b.gate.set()
            held.join()
            assert keys(c) == [root, child]


SYSTEM_A = " ".join(f"alpha{n}" for n in range(120))
SYSTEM_B = " ".join(f"beta{n}" for n in range(120))


def test_cache_aware_places_a_family_with_the_engine_holding_its_prefix() -> None:
    with engines(2) as (a, b):
        urls = [a.url, b.url]
        with gateway(urls, "--policy", "cache_aware", "--workers", "1") as client:
            # First families: empty trees, so the engine with the smaller tree (a, then b).
            first_a = root_not_on(0, urls, "first-a")
            first_b = root_not_on(1, urls, "first-b")
            turn(client, first_a, f"{SYSTEM_A} question one")
            turn(client, first_b, f"{SYSTEM_B} question two")
            # Families whose prompts share a cached prefix follow it.
            with_b = root_not_on(1, urls, "with-b")
            with_a = root_not_on(0, urls, "with-a")
            turn(client, with_b, f"{SYSTEM_B} question three")
            turn(client, with_a, f"{SYSTEM_A} question four")
            # Pinned: a later turn whose prompt matches the other engine's prefix stays put.
            turn(client, with_b, f"{SYSTEM_A} question five")
            assert keys(a) == [first_a, with_a]
            assert keys(b) == [first_b, with_b, with_b]


def test_a_refused_connection_replaces_the_family_by_policy_and_retries_the_turn() -> None:
    with engines(3) as (a, b, c):
        urls = [a.url, b.url, c.url]
        # Probes far apart: the turn itself finds a down, through its refused connection.
        argv = ["--policy", "least_in_flight", "--workers", "0", "--health-interval", "60"]
        with gateway(urls, *argv) as client:
            # A root whose rendezvous order goes a, then c: the policy's retry is b.
            n = 0
            while rendezvous_order(f"root-{n}", urls)[:2] != [0, 2]:
                n += 1
            root = f"root-{n}"
            turn(client, root)
            assert keys(a) == [root]
            a.stop()
            turn(client, root, "again")  # refused on a, retried once on b
            assert (keys(a), keys(b), keys(c)) == ([root], [root], [])
            assert engine_down(client, a.url)
            turn(client, root, "once more")
            assert keys(b) == [root, root]

"""Requests held for paused engines (engines/hold.py) and the registry's weight versions and
pause states (engines/registry.py), without processes: fake probes, a pool with no engine
behind it (nothing is sent; only picks and waits are exercised)."""

from __future__ import annotations

import asyncio

import pytest

from sessiongate.config.engines import EngineRoutingConfig
from sessiongate.engines.hold import HoldGate
from sessiongate.engines.pool import EnginePool
from sessiongate.engines.probe import ProbeResult
from sessiongate.engines.registry import OBSERVED, EngineRegistry
from sessiongate.errors import Unavailable

A, B = "http://a:1", "http://b:2"


def test_a_request_for_an_engine_not_held_goes_at_once() -> None:
    async def scenario() -> None:
        gate = HoldGate()
        gate.set_held([B])
        assert await gate.route(lambda: 0, [A, B].__getitem__) == 0
        assert gate.status()["released"] == 0

    asyncio.run(scenario())


def test_a_held_request_waits_and_picks_again_when_the_set_changes() -> None:
    async def scenario() -> None:
        gate = HoldGate()
        gate.set_held([A, B])
        picks: list[int] = []

        def pick() -> int:
            # The policy's view: the first engine not held, else the first.
            choice = next((i for i, u in enumerate([A, B]) if not gate.is_held(u)), 0)
            picks.append(choice)
            return choice

        waiter = asyncio.create_task(gate.route(pick, [A, B].__getitem__))
        await asyncio.sleep(0.01)
        assert not waiter.done() and gate.waiting == 1
        gate.set_held([A])  # B continues first: the request goes there, not to A
        assert await waiter == 1
        assert picks == [0, 1] and gate.waiting == 0 and gate.released == 1

    asyncio.run(scenario())


def test_the_queue_bound_and_the_wait_limit_answer_503() -> None:
    async def scenario() -> None:
        gate = HoldGate(queue_size=1, wait_secs=0.05)
        gate.set_held([A])
        first = asyncio.create_task(gate.route(lambda: 0, [A].__getitem__))
        await asyncio.sleep(0.01)
        with pytest.raises(Unavailable, match="--pause-queue-size 1"):
            await gate.route(lambda: 0, [A].__getitem__)
        with pytest.raises(Unavailable, match=r"stayed paused for 0\.05 s"):
            await first
        assert gate.refused == 2 and gate.waiting == 0

    asyncio.run(scenario())


def test_the_pool_picks_no_held_engine_and_a_pinned_family_waits_for_its_own() -> None:
    async def scenario() -> None:
        pool = EnginePool([A, B], engine_routing=EngineRoutingConfig(policy="round_robin"))
        pool.pins["fam"] = 0
        pool.set_urls([A, B], held=[A])
        # Stateless picks skip the held engine while the other can take them.
        assert {pool.index_for(None) for _ in range(6)} == {1}
        # A family pinned to the held engine stays pinned: its turn waits for it.
        turn = asyncio.create_task(pool._route("fam", [], b""))
        await asyncio.sleep(0.01)
        assert not turn.done()
        pool.set_urls([A, B], held=[])
        assert await turn == 0 and pool.pins["fam"] == 0
        assert pool.status()["held"] == {"held": [], "waiting": 0, "released": 1, "refused": 0}
        await pool.aclose()

    asyncio.run(scenario())


async def ready_probe(url: str) -> ProbeResult:
    return ProbeResult(None, {"model_path": "m", "weight_version": "v1"})


def test_the_registry_holds_paused_engines_and_tells_every_pool() -> None:
    sent: list[tuple[list[str], list[str]]] = []

    async def scenario() -> None:
        registry = EngineRegistry([A, B])

        async def changed(urls: list[str]) -> None:
            sent.append((urls, registry.held()))

        registry.on_change = changed
        engine = registry.engines[next(iter(registry.engines))]
        await registry.pause(engine, "retract")
        assert registry.held() == [A] and engine.describe()["pause_mode"] == "retract"
        await registry.resume(engine)
        assert registry.held() == []

    asyncio.run(scenario())
    assert sent == [([A, B], [A]), ([A, B], [])]


def test_a_pause_is_observed_from_ready_unless_a_control_call_overlaps() -> None:
    answers: list[bool | None] = [False]

    async def ready(url: str, timeout: float) -> bool | None:
        return answers[0]

    async def healthy(url: str, path: str, timeout: float) -> str | None:
        return None

    async def scenario() -> None:
        registry = EngineRegistry([A], checker=healthy, ready_checker=ready)
        engine = registry.engines[next(iter(registry.engines))]
        engine.model_info = {"model_path": "m"}
        registry.control_started(engine)
        await registry.probe_once()
        assert engine.paused is None  # a pause through the plane is in progress: its word
        registry.control_ended(engine)
        await registry.probe_once()
        assert engine.paused == OBSERVED and registry.held() == [A]
        answers[0] = None  # an engine without /ready says nothing: the state stays
        await registry.probe_once()
        assert engine.paused == OBSERVED
        answers[0] = True
        await registry.probe_once()
        assert engine.paused is None and registry.held() == []

    asyncio.run(scenario())


def test_newest_weights_only_holds_engines_behind_the_newest_version() -> None:
    async def scenario() -> None:
        registry = EngineRegistry([], prober=ready_probe, newest_weights_only=True)
        first, _ = await registry.add("http://e:1")
        second, _ = await registry.add("http://e:2")
        assert first.weight_version == second.weight_version == "v1"
        assert registry.newest_version == "v1" and registry.held() == []
        first.weight_version = "v2"
        registry.newest_version = "v2"  # what a weight update through the plane records
        assert registry.held() == ["http://e:2"]
        second.weight_version = None  # not known: not held
        assert registry.held() == []

    asyncio.run(scenario())


def test_labels_come_from_the_flag_and_the_registration() -> None:
    async def scenario() -> None:
        registry = EngineRegistry([A, B], labels=("pool=x", f"{B}#role=actor"), prober=ready_probe)
        rows = {e.url: e.labels for e in registry.listing()}
        assert rows == {A: {"pool": "x"}, B: {"pool": "x", "role": "actor"}}
        engine, _ = await registry.add("http://e:3", {"role": "rollout"})
        assert engine.labels == {"role": "rollout"}
        again, created = await registry.add("http://e:3", {"zone": "1"})
        assert again is engine and not created and engine.labels == {"role": "rollout", "zone": "1"}
        with pytest.raises(SystemExit, match="not a --backend engine"):
            EngineRegistry([A], labels=("http://nope:1#k=v",))

    asyncio.run(scenario())


def test_settle_waits_for_requests_picked_before_the_hold_to_be_written() -> None:
    async def scenario() -> None:
        gate = HoldGate()
        written = gate.sending(A)
        other = gate.sending(B)
        gate.set_held([A])
        settled = asyncio.create_task(gate.settle(5.0))
        await asyncio.sleep(0.01)
        assert not settled.done()  # a request to A is still being written
        other()  # B is not held: its request does not count
        await asyncio.sleep(0.01)
        assert not settled.done()
        written()
        written()  # twice is once
        await asyncio.wait_for(settled, 1.0)
        # Nothing unwritten: at once; and bounded by its timeout otherwise.
        await asyncio.wait_for(gate.settle(5.0), 1.0)
        gate.sending(A)
        await asyncio.wait_for(gate.settle(0.05), 1.0)

    asyncio.run(scenario())


def test_an_engine_that_goes_down_is_no_longer_held() -> None:
    """SGLang's `/ready` is 503 while it shuts down too: the engine looks paused, then is
    gone. Requests must not wait for it: once its health probe fails it is released."""
    health: list[str | None] = [None]

    async def ready(url: str, timeout: float) -> bool | None:
        return False

    async def check(url: str, path: str, timeout: float) -> str | None:
        return health[0]

    async def scenario() -> None:
        registry = EngineRegistry([A], checker=check, ready_checker=ready)
        (engine,) = registry.listing()
        engine.model_info = {"model_path": "m"}
        await registry.probe_once()
        assert engine.paused == OBSERVED and registry.held() == [A]
        health[0] = "connection refused"
        await registry.probe_once()
        assert engine.paused is None and registry.held() == []
        # A pause through the plane of an engine that then dies is released too.
        await registry.pause(engine, "retract")
        await registry.probe_once()
        assert engine.paused is None

    asyncio.run(scenario())

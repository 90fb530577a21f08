"""Where `EnginePool` places a session family: by the engine routing policy from the
family's first call (then pinned for its life), by rendezvous hashing of the root id under
round_robin, and off a down engine by the policy again. No engine process: the pool's clients
are replaced by fakes that record what they were sent and can hold a call in flight."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import pytest

from sessiongate.engines.client import EngineReply, EngineUnreachable
from sessiongate.engines.policy import EngineRoutingConfig
from sessiongate.engines.pool import EnginePool, rendezvous_order

URLS = ["http://e0:1", "http://e1:1", "http://e2:1"]


class FakeClient:
    """Stands in for an `EngineClient`: answers 200, or refuses the connection, and holds
    each call until `release` is set (so a test can keep requests in flight)."""

    def __init__(self, url: str) -> None:
        self.base_url = url
        self.sent: list[bytes] = []
        self.refuse = False
        self.release = asyncio.Event()
        self.release.set()

    async def post_json(
        self,
        path: str,
        body: bytes,
        headers: list[tuple[str, str]],
        on_sent: Callable[[], None] | None = None,
    ) -> EngineReply:
        if self.refuse:
            raise EngineUnreachable("connection refused", base_url=self.base_url)
        self.sent.append(body)
        if on_sent is not None:
            on_sent()
        await self.release.wait()
        return EngineReply(200, [], b"{}")

    async def aclose(self) -> None:
        pass


def pool_with(policy: str, urls: list[str] = URLS) -> tuple[EnginePool, list[FakeClient]]:
    pool = EnginePool(urls, engine_routing=EngineRoutingConfig(policy=policy))
    fakes = [FakeClient(u) for u in urls]
    pool.clients = fakes  # type: ignore[assignment]
    return pool, fakes


def chat(text: str) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": text}]}).encode()


def ids(tokens: list[int]) -> bytes:
    return json.dumps({"input_ids": tokens}).encode()


def test_least_in_flight_places_a_family_on_the_idle_engine_and_keeps_it_there() -> None:
    pool, _ = pool_with("least_in_flight")
    pool.engine_policy.started(0)  # engine 0 busy
    assert pool.index_for("fam", [], chat("hi")) == 1
    # Pinned for life: engine 1 being the busiest now does not move it.
    for _ in range(3):
        pool.engine_policy.started(1)
    assert pool.index_for("fam", [], chat("again")) == 1
    assert pool.affinity_hits == 1 and pool.repins == 0 and pool.pins == {"fam": 1}


def test_cache_aware_places_a_family_with_the_engine_holding_its_prefix() -> None:
    pool, _ = pool_with("cache_aware")
    shared = list(range(100, 400))
    # Two stateless prompts: the first goes to engine 0 (all trees empty), the second, which
    # shares nothing, to the smallest tree (engine 1), as cache_aware does.
    assert pool.index_for(None, [], ids(list(range(1000, 1300)))) == 0
    assert pool.index_for(None, [], ids(shared)) == 1
    pool.engine_policy.prefilled(1, [], ids(shared))  # engine 1 answered it
    # A family whose first prompt extends the second lands with it, then stays.
    assert pool.index_for("fam", [], ids([*shared, 7, 8, 9])) == 1
    assert pool.index_for("fam", [], ids(list(range(1000, 1300)))) == 1


def test_round_robin_keeps_rendezvous_placement_and_leaves_the_turn_order_alone() -> None:
    pool, _ = pool_with("round_robin")
    assert not pool.places_by_policy
    roots = [f"root-{n}" for n in range(20)]
    for root in roots:
        assert pool.index_for(root, [], chat("x")) == rendezvous_order(root, URLS)[0]
    # The families took no turns from the stateless rotation.
    assert [pool.index_for(None, [], b"{}") for _ in range(3)] == [0, 1, 2]


def test_a_family_on_a_down_engine_is_replaced_by_the_policy_among_the_others() -> None:
    pool, _ = pool_with("least_in_flight")
    assert pool.index_for("fam", [], chat("hi")) == 0
    pool._mark(0, "gone")
    pool.engine_policy.started(1)  # of the two left, engine 2 is the idle one
    assert pool.index_for("fam", [], chat("hi")) == 2
    assert pool.repins == 1
    pool._mark(0, None)  # back up: the family stays where it was re-pinned
    assert pool.index_for("fam", [], chat("hi")) == 2


def test_retry_off_a_failed_engine_when_every_engine_is_down_takes_another() -> None:
    pool, _ = pool_with("least_in_flight")
    assert pool.index_for("fam", [], chat("hi")) == 0
    for index in range(3):
        pool._mark(index, "gone")
    retry = pool._failed("fam", 0, [], chat("hi"))
    assert retry is not None and retry != 0 and pool.pins["fam"] == retry


def test_model_info_lookup_does_not_place_the_family() -> None:
    pool, _ = pool_with("least_in_flight")
    assert pool._peek("fam") == rendezvous_order("fam", URLS)[0]
    assert pool.pins == {}


@pytest.mark.parametrize("policy", ["least_in_flight", "cache_aware"])
def test_a_family_turn_in_flight_counts_for_the_next_placement(policy: str) -> None:
    async def scenario() -> None:
        pool, fakes = pool_with(policy, URLS[:2])
        fakes[0].release.clear()  # family a's turn stays in flight on engine 0
        first = asyncio.create_task(pool.post_json("a", "/v1/chat/completions", chat("a")))
        while not fakes[0].sent:
            await asyncio.sleep(0)
        assert pool.pins["a"] == 0
        # cache_aware balances only past its thresholds: make engine 0 clearly busier.
        for _ in range(100 if policy == "cache_aware" else 0):
            pool.engine_policy.started(0)
        await pool.post_json("b", "/v1/chat/completions", chat("b"))
        assert pool.pins["b"] == 1
        fakes[0].release.set()
        await first
        await pool.aclose()

    asyncio.run(scenario())


def test_a_refused_connection_repins_by_policy_and_retries_once() -> None:
    async def scenario() -> None:
        pool, fakes = pool_with("least_in_flight")
        assert pool.index_for("fam", [], chat("hi")) == 0
        fakes[0].refuse = True
        pool.engine_policy.started(1)  # engine 2 is the least busy of the others
        reply = await pool.post_json("fam", "/v1/chat/completions", chat("turn 2"))
        assert reply.status == 200
        assert [len(f.sent) for f in fakes] == [0, 0, 1]
        assert pool.pins["fam"] == 2 and not pool.healthy[0] and pool.repins == 1
        # The failed attempt and the retry both finished: only the manual count remains.
        assert pool.engine_policy.in_flight == [0, 1, 0]
        await pool.aclose()

    asyncio.run(scenario())

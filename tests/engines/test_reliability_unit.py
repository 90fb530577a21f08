"""The circuit breaker, the backoff schedule and the health thresholds as decisions of a fake
clock (engines/reliability.py), and the upstream pool using them against scripted
clients: no timing, no sockets, no processes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from sessiongate.engines.client import EngineReply, EngineUnreachable
from sessiongate.engines.policy import EngineRoutingConfig
from sessiongate.engines.pool import EnginePool
from sessiongate.engines.reliability import (
    CLOSED,
    HALF_OPEN,
    OPEN,
    CircuitBreaker,
    HealthCounter,
    ReliabilityConfig,
    backoff_ms,
)


def test_defaults_are_the_gateways() -> None:
    c = ReliabilityConfig()
    assert (c.health_failure_threshold, c.health_success_threshold) == (3, 2)
    assert (c.health_check_timeout_secs, c.health_check_endpoint) == (5.0, "/health")
    assert (c.retry_max_retries, c.retry_initial_backoff_ms, c.retry_max_backoff_ms) == (
        5,
        50,
        30_000,
    )
    assert (c.retry_backoff_multiplier, c.retry_jitter_factor) == (1.5, 0.2)
    assert (c.cb_failure_threshold, c.cb_success_threshold) == (10, 3)
    assert (c.cb_timeout_duration_secs, c.cb_window_duration_secs) == (60.0, 120.0)
    assert not c.disable_retries and not c.disable_circuit_breaker
    assert c.attempts == 5
    assert ReliabilityConfig(disable_retries=True).attempts == 1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("retry_max_retries", 0),
        ("cb_failure_threshold", 0),
        ("retry_backoff_multiplier", 0.5),
        ("retry_jitter_factor", 1.5),
        ("cb_timeout_duration_secs", 0.0),
        ("health_check_endpoint", "health"),
        ("retry_initial_backoff_ms", -1),
    ],
)
def test_bad_values_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        ReliabilityConfig(**{field: value})  # type: ignore[arg-type]


def test_backoff_schedule() -> None:
    # The Gateway's defaults without jitter: 50 ms times 1.5 per attempt, capped.
    assert [backoff_ms(a, 50, 30_000, 1.5, 0.0, 0.7) for a in range(5)] == [50, 75, 112, 168, 253]
    assert [backoff_ms(a, 100, 250, 2.0, 0.0, 0.0) for a in range(4)] == [100, 200, 250, 250]
    # Jitter moves it by at most its share, both ways, and never below 0.
    assert backoff_ms(0, 100, 1000, 2.0, 0.2, 1.0) == 120
    assert backoff_ms(0, 100, 1000, 2.0, 0.2, -1.0) == 80
    assert backoff_ms(0, 100, 1000, 2.0, 1.0, -1.0) == 0
    assert backoff_ms(10**6, 1, 2**40, 2.0, 0.0, 0.0) == 2**40


def test_breaker_opens_at_the_threshold_and_half_opens_after_the_timeout() -> None:
    b = CircuitBreaker(failure_threshold=3, success_threshold=2, timeout_secs=10, window_secs=100)
    assert b.record(False, 0.0) == CLOSED
    assert b.record(True, 0.5) == CLOSED  # a success ends the streak
    assert [b.record(False, t) for t in (1.0, 2.0, 3.0)] == [CLOSED, CLOSED, OPEN]
    assert b.opened == 1
    assert not b.allows(12.9)
    assert b.state(13.0) == HALF_OPEN and b.allows(13.0)
    assert b.record(True, 13.0) == HALF_OPEN
    assert b.record(True, 13.1) == CLOSED


def test_a_half_open_failure_opens_it_again_for_a_full_timeout() -> None:
    b = CircuitBreaker(failure_threshold=1, success_threshold=3, timeout_secs=5, window_secs=60)
    assert b.record(False, 0.0) == OPEN
    assert b.state(5.0) == HALF_OPEN
    assert b.record(True, 5.0) == HALF_OPEN
    assert b.record(False, 6.0) == OPEN
    assert b.state(10.9) == OPEN
    assert b.state(11.0) == HALF_OPEN
    assert b.opened == 2


def test_a_streak_longer_than_the_window_starts_over() -> None:
    b = CircuitBreaker(failure_threshold=3, success_threshold=1, timeout_secs=5, window_secs=10)
    b.record(False, 0.0)
    b.record(False, 5.0)
    assert b.record(False, 10.5) == CLOSED  # the streak began 10.5 s ago: it restarts
    assert b.record(False, 11.0) == CLOSED
    assert b.record(False, 12.0) == OPEN


def test_a_disabled_breaker_stays_closed() -> None:
    b = CircuitBreaker(1, 1, 5, 10, disabled=True)
    assert all(b.record(False, float(t)) == CLOSED for t in range(50))
    assert b.allows(0.0)


def test_health_thresholds() -> None:
    h = HealthCounter(failures=3, successes=2)
    assert [h.probe(False, True), h.probe(False, True), h.probe(False, True)] == [True, True, False]
    assert h.probe(True, False) is False
    assert h.probe(False, False) is False  # a failure between passes restarts the count
    assert [h.probe(True, False), h.probe(True, False)] == [False, True]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Scripted:
    """Stands in for an `EngineClient`: answers each POST with the next scripted status
    (or raises `EngineUnreachable` for "refused"), then 200."""

    def __init__(self, url: str, script: list[int | str]) -> None:
        self.base_url = url
        self.script = list(script)
        self.posts = 0

    async def post_json(
        self, path: str, body: bytes, headers: object = (), on_sent: object = None
    ) -> EngineReply:
        self.posts += 1
        step = self.script.pop(0) if self.script else 200
        if step == "refused":
            raise EngineUnreachable(f"{self.base_url}: refused", base_url=self.base_url)
        assert isinstance(step, int)
        return EngineReply(status=step, headers=[], body=b"{}")

    async def aclose(self) -> None:
        pass


@pytest.fixture
def no_sleep(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    """Backoffs are recorded, not waited for."""
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    monkeypatch.setattr("sessiongate.engines.pool.asyncio.sleep", sleep)
    yield waits


def make_pool(
    scripts: list[list[int | str]], clock: Clock, **config: object
) -> tuple[EnginePool, list[Scripted]]:
    urls = [f"http://e{i}:1" for i in range(len(scripts))]
    pool = EnginePool(
        urls,
        reliability=ReliabilityConfig(retry_jitter_factor=0.0, **config),  # type: ignore[arg-type]
        clock=clock,
        # Round robin whatever the default: the tests count where requests go.
        engine_routing=EngineRoutingConfig(policy="round_robin"),
    )
    clients = [Scripted(url, script) for url, script in zip(urls, scripts, strict=True)]
    pool.clients = clients  # type: ignore[assignment]
    return pool, clients


def test_503_twice_then_200_is_retried_with_backoff(no_sleep: list[float]) -> None:
    pool, (engine,) = make_pool([[503, 503]], Clock())
    reply = asyncio.run(pool.post_json(None, "/v1/completions", b"{}"))
    assert reply.status == 200 and engine.posts == 3
    assert no_sleep == [0.05, 0.075]
    assert pool.upstream_states()[0]["retries"] == 2


def test_without_retries_the_503_is_the_reply(no_sleep: list[float]) -> None:
    pool, (engine,) = make_pool([[503, 503]], Clock(), disable_retries=True)
    assert asyncio.run(pool.post_json(None, "/v1/completions", b"{}")).status == 503
    assert engine.posts == 1 and no_sleep == []


def test_500_is_not_retried(no_sleep: list[float]) -> None:
    pool, (engine,) = make_pool([[500]], Clock())
    assert asyncio.run(pool.post_json(None, "/v1/completions", b"{}")).status == 500
    assert engine.posts == 1


def test_retries_stop_at_max_retries_attempts_in_all(no_sleep: list[float]) -> None:
    pool, (engine,) = make_pool([[429] * 10], Clock(), retry_max_retries=3)
    assert asyncio.run(pool.post_json(None, "/v1/completions", b"{}")).status == 429
    assert engine.posts == 3 and len(no_sleep) == 2


def test_a_family_stays_on_its_engine_through_503s(no_sleep: list[float]) -> None:
    pool, clients = make_pool([[503, 503], [503, 503]], Clock())
    home = pool.index_for("root-1")
    assert asyncio.run(pool.post_json("root-1", "/v1/completions", b"{}")).status == 200
    assert clients[home].posts == 3 and clients[1 - home].posts == 0
    assert pool.repins == 0


def test_a_family_moves_when_its_engine_refuses_connections(no_sleep: list[float]) -> None:
    pool, clients = make_pool([["refused"] * 9, ["refused"] * 9], Clock())
    home = pool.index_for("root-1")
    clients[1 - home].script = []
    assert asyncio.run(pool.post_json("root-1", "/v1/completions", b"{}")).status == 200
    assert clients[home].posts == 1 and clients[1 - home].posts == 1
    assert pool.pins["root-1"] == 1 - home and pool.repins == 1


def test_an_open_breaker_takes_the_engine_out_until_its_timeout(no_sleep: list[float]) -> None:
    clock = Clock()
    pool, (bad, good) = make_pool(
        [[500] * 3, []],
        clock,
        cb_failure_threshold=3,
        cb_success_threshold=2,
        cb_timeout_duration_secs=30.0,
    )

    async def send(n: int) -> list[int]:
        return [(await pool.post_json(None, "/v1/completions", b"{}")).status for _ in range(n)]

    # Round robin: every other request meets the failing engine, until its third 500.
    statuses = asyncio.run(send(6))
    assert statuses.count(500) == 3 and bad.posts == 3
    assert pool.upstream_states()[0]["circuit_breaker"] == "open"
    asyncio.run(send(10))
    assert bad.posts == 3 and good.posts == 13  # no traffic while open
    # A family pinned there moves too.
    assert pool.index_for("some-root") == 1
    clock.now = 30.0
    asyncio.run(send(4))  # half-open: trials reach it again, two successes close it
    assert bad.posts == 5
    assert pool.upstream_states()[0]["circuit_breaker"] == "closed"


def test_probes_flip_health_only_at_their_thresholds() -> None:
    pool, _ = make_pool([[]], Clock())
    for _ in range(2):
        pool._probed(0, "GET /health failed")
    assert pool.healthy[0]
    pool._probed(0, "GET /health failed")
    assert not pool.healthy[0] and pool.last_error[0] == "GET /health failed"
    pool._probed(0, None)
    assert not pool.healthy[0]
    pool._probed(0, None)
    assert pool.healthy[0] and pool.last_error[0] is None

"""The `GET /v1/loads` poll (engines/loads.py): SGLang's document read into one report per
engine, every engine polled each round, and an engine that accepts the connection and never
answers (or answers garbage) costs a timeout in the poll, never a wait in routing: it has no
report until it answers again, and the policy scores it on requests in flight."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Iterator

import pytest

from sessiongate.config.engines import EngineRoutingConfig
from sessiongate.engines.loads import LoadPoll, fetch_loads, parse_loads
from sessiongate.engines.policy import LoadReport
from sessiongate.engines.pool import EnginePool
from sessiongate.engines.registry import EngineRegistry
from support.http_stub import json_stub


def rank(dp_rank: int, **fields: object) -> dict[str, object]:
    """One DP rank as SGLang 0.5.23's LoadSnapshot.to_dict has it (core keys)."""
    base: dict[str, object] = {
        "timestamp": 1.0,
        "dp_rank": dp_rank,
        "num_running_reqs": 0,
        "num_waiting_reqs": 0,
        "num_waiting_uncached_tokens": 0,
        "num_used_tokens": 0,
        "num_total_tokens": 0,
        "num_active_tokens": 0,
        "num_prealloc_ready_tokens": 0,
        "max_total_num_tokens": 1000,
        "max_running_requests": 8,
        "token_usage": 0.0,
        "gen_throughput": 0.0,
        "cache_hit_rate": 0.0,
        "utilization": 0.0,
        "total_prefill_uncached_tokens": 0,
        "total_prefill_busy_us": 0,
        "decode_moments": None,
    }
    base.update(fields)
    return base


def loads_doc(*ranks: dict[str, object]) -> bytes:
    return json.dumps(
        {
            "timestamp": "2026-01-01T00:00:00+00:00",
            "version": "0.5.23",
            "accelerator": None,
            "num_accelerators": 1,
            "loads": list(ranks),
        }
    ).encode()


@contextlib.contextmanager
def silent_engine() -> Iterator[str]:
    """A socket that accepts connections (the kernel's backlog) and never answers."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_parse_sums_ranks_and_averages_kv_usage() -> None:
    body = loads_doc(
        rank(0, num_running_reqs=3, num_waiting_reqs=1, num_waiting_uncached_tokens=500,
             token_usage=0.5, gen_throughput=800.0),
        rank(1, num_running_reqs=2, num_waiting_reqs=4, num_waiting_uncached_tokens=70,
             token_usage=0.25, gen_throughput=700),
    )  # fmt: skip
    assert parse_loads(body) == LoadReport(5, 5, 570, 0.375, 1500.0)
    # Missing or odd fields count as 0 (msgspec omits defaults); the rest still counts.
    assert parse_loads(b'{"loads": [{"num_running_reqs": true, "token_usage": "x"}]}') == (
        LoadReport(0, 0, 0, 0.0, 0.0)
    )


@pytest.mark.parametrize(
    "body",
    [b"", b"garbage", b"[]", b'{"loads": []}', b'{"loads": {}}', b'{"loads": [1]}', b"{}"],
)
def test_parse_refuses_what_is_not_the_document(body: bytes) -> None:
    assert parse_loads(body) is None


def test_fetch_reads_a_stub_and_gives_up_on_a_silent_engine() -> None:
    async def both(stub_url: str, silent_url: str) -> tuple[object, object, float]:
        began = time.monotonic()
        good, bad = await asyncio.gather(fetch_loads(stub_url, 0.5), fetch_loads(silent_url, 0.5))
        return good, bad, time.monotonic() - began

    with json_stub(loads_doc(rank(0, num_waiting_reqs=2))) as stub, silent_engine() as silent:
        good, bad, took = asyncio.run(both(f"http://127.0.0.1:{stub.port}", silent))
    assert good == LoadReport(0, 2, 0, 0.0, 0.0)
    assert bad is None
    assert took < 3.0


def test_garbage_and_errors_give_no_report() -> None:
    with json_stub(b"<html>not loads</html>") as stub:
        assert asyncio.run(fetch_loads(f"http://127.0.0.1:{stub.port}", 2.0)) is None
    # Nothing listening at all.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert asyncio.run(fetch_loads(f"http://127.0.0.1:{port}", 2.0)) is None


def test_a_silent_engine_does_not_hold_back_the_others() -> None:
    seen: list[tuple[str, LoadReport | None, float]] = []

    async def round_of(urls: list[str]) -> float:
        poll = LoadPoll(lambda: urls, interval=10, timeout=0.5)
        began = time.monotonic()
        poll.feed(lambda url, report: seen.append((url, report, time.monotonic() - began)))
        await poll.poll_once()
        return time.monotonic() - began

    with json_stub(loads_doc(rank(0, num_running_reqs=1))) as stub, silent_engine() as silent:
        stub_url = f"http://127.0.0.1:{stub.port}"
        took = asyncio.run(round_of([silent, stub_url]))
    outcome = {url: report for url, report, _ in seen}
    assert outcome == {stub_url: LoadReport(1, 0, 0, 0.0, 0.0), silent: None}
    # The answering engine's report arrived at once, the silent one's verdict at the timeout.
    when = {url: at for url, _, at in seen}
    assert when[stub_url] < 0.4 <= when[silent] and took < 3.0


@pytest.mark.parametrize("impl", ["rust", "python"])
def test_registry_poll_feeds_a_pool_policy_without_stalling_picks(
    impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """least_load over an engine reporting a long queue and one that never answers its
    poll: picks answer at once while the poll hangs; once the poll gave up on the silent
    engine, it is scored on requests in flight (0: it wins) until those outweigh the
    other's queue."""
    monkeypatch.setenv("SESSIONGATE_IMPL", impl)
    heavy = loads_doc(rank(0, num_waiting_uncached_tokens=100_000, gen_throughput=1000.0))

    async def scenario(stub_url: str, silent: str) -> list[int]:
        registry = EngineRegistry(
            [stub_url, silent], interval=60, health_timeout=0.5, load_interval=1.0
        )
        routing = EngineRoutingConfig(policy="least_load", seed=1)
        pool = EnginePool([stub_url, silent], engine_routing=routing)
        pool.fed_by(registry.feed)
        pool.fed_loads_by(registry.feed_loads)
        registry.start()
        pool.start()
        try:
            began = time.monotonic()
            policy = pool.engine_policy
            policy.pick([], b"{}")  # the poll is under way: no wait
            assert time.monotonic() - began < 0.1
            await asyncio.sleep(0.8)  # past the silent engine's poll timeout
            picks = [policy.pick([], b"{}") for _ in range(5)]
            for _ in range(97):
                policy.started(1)
            picks.append(policy.pick([], b"{}"))  # 97 x 1024 / 1000 = 99.3 s < 100 s
            for _ in range(3):
                policy.started(1)
            picks.append(policy.pick([], b"{}"))  # 100 x 1.024 = 102.4 s > 100 s
            return picks
        finally:
            await pool.aclose()
            await registry.aclose()

    with json_stub(heavy) as stub, silent_engine() as silent:
        picks = asyncio.run(scenario(f"http://127.0.0.1:{stub.port}", silent))
        assert stub.gets["/v1/loads"] >= 1
    assert picks == [1, 1, 1, 1, 1, 1, 0]


def test_only_load_reading_policies_poll() -> None:
    assert EngineRoutingConfig(policy="least_load").reads_loads
    assert EngineRoutingConfig(policy="power_of_two").reads_loads
    assert not EngineRoutingConfig(
        policy="power_of_two", power_of_two_load_metric="least_requests"
    ).reads_loads
    assert not EngineRoutingConfig(policy="prefix_hash").reads_loads
    assert not EngineRoutingConfig().reads_loads
    assert EngineRegistry(["http://e:1"]).load_poll is None

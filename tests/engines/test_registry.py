"""The engine registry and the management dialects, without processes: a fake probe."""

from __future__ import annotations

import asyncio
import json

import pytest

from sessiongate.engines.management import EngineManagement
from sessiongate.engines.pool import EnginePool
from sessiongate.engines.probe import ProbeResult
from sessiongate.engines.registry import BadEngineUrl, EngineRegistry, engine_id, normalise_url
from sessiongate.protocol import CoreRequest, Op


async def fake_probe(url: str) -> ProbeResult:
    return ProbeResult("refused" if url.endswith(":1") else None, {"model_path": "m"})


def test_urls_are_normalised_and_ids_stable() -> None:
    assert normalise_url(" HTTP://Host:30000/ ") == "http://host:30000"
    assert engine_id("http://h:1") == engine_id(normalise_url("http://h:1/"))
    for bad in ("ftp://h:1", "http://", "http://h:1/?x=1", "http://u:p@h:1", "http://h:99999"):
        with pytest.raises(BadEngineUrl):
            normalise_url(bad)


def test_registration_admits_ready_engines_and_replaces_the_placeholder() -> None:
    sets: list[list[str]] = []

    async def changed(urls: list[str]) -> None:
        sets.append(urls)

    async def scenario() -> None:
        registry = EngineRegistry(
            ["http://mock:9"], placeholder=True, on_change=changed, prober=fake_probe
        )
        engine, created = await registry.add("http://e:2/")
        assert created and engine.state == "ready"
        bad, _ = await registry.add("http://bad:1")
        assert bad.state == "unreachable: refused" and not bad.admitted
        assert registry.urls() == ["http://e:2"]
        again, created = await registry.add("http://e:2")
        assert again is engine and not created
        assert await registry.remove("http://e:2") is engine
        assert await registry.remove("http://e:2") is None

    asyncio.run(scenario())
    # The mock leaves before the new engine is probed; the bad URL never enters.
    assert sets == [[], ["http://e:2"], []]


def request(method: str, path: str, body: object = None, query: str = "") -> CoreRequest:
    raw = b"" if body is None else json.dumps(body).encode()
    return CoreRequest(op=Op.ENGINES, path=path, method=method, query=query, body=raw)


def test_dialects() -> None:
    async def scenario() -> None:
        management = EngineManagement(EngineRegistry([], prober=fake_probe))
        reply = await management.handle(
            request("POST", "/add_worker", query="worker_url=http://a:1")
        )
        assert reply.status == 200  # accepted and listed, though unreachable
        reply = await management.handle(
            request("POST", "/add_worker", {"worker_url": "http://a:2"})
        )
        assert reply.status == 200
        reply = await management.handle(request("POST", "/workers", {"url": "http://b:3"}))
        assert reply.status == 202 and json.loads(reply.body)["status"] == "accepted"
        reply = await management.handle(request("GET", "/list_workers"))
        assert json.loads(reply.body) == {"urls": ["http://a:1", "http://a:2", "http://b:3"]}
        reply = await management.handle(
            request("POST", "/workers", {"url": "http://c:4", "worker_type": "decode"})
        )
        assert reply.status == 400 and "decode" in json.loads(reply.body)["error"]
        reply = await management.handle(request("DELETE", "/workers/http%3A%2F%2Fb%3A3"))
        assert reply.status == 200
        reply = await management.handle(request("DELETE", "/workers/nope"))
        assert reply.status == 404

    asyncio.run(scenario())


def test_pool_set_urls_keeps_kept_engines_and_drops_removed_pins() -> None:
    async def scenario() -> None:
        pool = EnginePool(["http://a:1", "http://b:2"])
        kept = pool.clients[1]
        pool.healthy[1] = False
        pool.pins = {"fam-a": 0, "fam-b": 1}
        pool.set_urls(["http://b:2", "http://c:3"])
        assert pool.clients[0] is kept and pool.healthy == [False, True]
        assert pool.pins == {"fam-b": 0}
        pool.set_urls([])
        with pytest.raises(Exception, match="no engine registered yet"):
            pool.index_for(None)
        await pool.aclose()

    asyncio.run(scenario())


def test_one_prober_feeds_the_pools_of_its_process() -> None:
    """Each round checks each engine once (the embedded mock too: the pools have it), with
    the configured path and timeout; every fed pool takes the verdict at its thresholds and
    runs no health loop of its own; the registry's state follows the verdict at once."""
    checked: list[tuple[str, str, float]] = []
    verdicts = {"http://a:1": "GET http://a:1/ready answered 503", "http://b:2": None}

    async def checker(url: str, path: str, timeout: float) -> str | None:
        checked.append((url, path, timeout))
        return verdicts[url]

    async def scenario() -> None:
        pool = EnginePool(["http://A:1/", "http://b:2"])  # as typed on the command line
        registry = EngineRegistry(
            pool.urls, health_path="/ready", health_timeout=0.5, checker=checker
        )
        registry.engines[engine_id("http://b:2")].model_info = {"model_path": "m"}
        fed: list[tuple[str, str | None]] = []
        pool.fed_by(registry.feed)
        registry.feed(lambda url, error: fed.append((url, error)))
        pool.start()
        assert pool._prober is None  # fed: no loop of its own
        for _ in range(3):  # the failure threshold
            await registry.probe_once()
        assert sorted(checked) == sorted(
            [("http://a:1", "/ready", 0.5), ("http://b:2", "/ready", 0.5)] * 3
        )
        assert fed.count(("http://a:1", verdicts["http://a:1"])) == 3
        assert pool.healthy == [False, True]
        assert pool.last_error[0] == verdicts["http://a:1"]
        a = registry.engines[engine_id("http://a:1")]
        assert not a.healthy and a.state.endswith("answered 503")
        await pool.aclose()
        await registry.aclose()

    asyncio.run(scenario())


def test_the_embedded_mock_is_probed_for_the_pools_only() -> None:
    checked: list[str] = []

    async def checker(url: str, path: str, timeout: float) -> str | None:
        checked.append(url)
        return "down"

    async def scenario() -> None:
        registry = EngineRegistry(["http://mock:9"], placeholder=True, checker=checker)
        fed: list[tuple[str, str | None]] = []
        registry.feed(lambda url, error: fed.append((url, error)))
        await registry.probe_once()
        assert checked == ["http://mock:9"] and fed == [("http://mock:9", "down")]
        [mock] = registry.listing()
        assert mock.healthy  # the placeholder's state is not the registry's to keep

    asyncio.run(scenario())

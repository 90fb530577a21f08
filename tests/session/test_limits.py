"""Abuse limits (docs/reliability.md, "Limits"): the live-session cap (429), the records
memory budget (503, refused before the upstream is asked), the idle TTL of path-created
sessions (404 "expired"), and the figures in /health and /metrics. End to end against real
`serve` and `mock-engine` processes, plus the core's byte accounting driven in-process."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from sessiongate.config.records import LimitsConfig
from sessiongate.engines.pool import EnginePool
from sessiongate.protocol import CoreReply, CoreRequest
from sessiongate.session import session_table
from sessiongate.session.core import SessionCore
from sessiongate.session.limit_options import (
    AUTO,
    auto_records_bytes,
    limit_settings,
    limits_for_workers,
    parse_size,
)
from sessiongate.session.settings import SessionSettings
from sessiongate.tokenizer import load_tokenizer
from support.procs import ServerProcess, free_port, mock_engine

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

R3_ENGINE = ("--r3-layers", "4", "--r3-topk", "2")


@pytest.fixture(scope="module")
def engine() -> Iterator[ServerProcess]:
    with mock_engine(*R3_ENGINE) as proc:
        yield proc


def _serve(engine: ServerProcess, *extra: str) -> ServerProcess:
    port = free_port()
    return ServerProcess(
        ["serve", "--port", str(port), "--backend", engine.url, "--r3", "--r3-topk", "2", *extra],
        port,
    )


def _engine_requests(engine: ServerProcess) -> int:
    count: int = httpx.get(engine.url + "/mock/stats", timeout=10).json()["requests"]
    return count


def _until(condition: Callable[[], bool], what: str) -> None:
    """Poll for something the heartbeat or the expiry task will make true (no deadline on
    how soon: only a generous one against hanging)."""
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


def _turn(client: httpx.Client, session_id: str, messages: list[dict[str, Any]]) -> Any:
    return client.post(
        f"/sessions/{session_id}/v1/chat/completions",
        json={"messages": messages, "max_tokens": 16},
    )


def _retry_after(response: httpx.Response) -> int:
    seconds = int(response.headers["retry-after"])
    assert seconds > 0
    return seconds


def _worker(client: httpx.Client, index: int = 0) -> dict[str, Any]:
    state: dict[str, Any] = client.get("/health").json()["workers"][index]
    return state


# -- end to end ---------------------------------------------------------------------------


def test_session_cap_answers_429_until_a_session_is_deleted(engine: ServerProcess) -> None:
    with (
        _serve(engine, "--workers", "1", "--max-sessions", "3") as gateway,
        httpx.Client(base_url=gateway.url, timeout=30) as client,
    ):
        root = client.post("/sessions").json()["session_id"]
        child = client.post("/sessions", json={"parent_session_id": root})
        assert child.status_code == 200, child.text
        assert client.post("/sessions").status_code == 200

        refused = [
            client.post("/sessions"),
            client.post("/sessions", json={"parent_session_id": root}),
            # A header-identified session created on first use counts the same.
            client.post(
                "/v1/chat/completions",
                headers={"X-Session-ID": "agent-7"},
                json={"messages": [{"role": "user", "content": "hi"}]},
            ),
        ]
        for response in refused:
            assert response.status_code == 429, response.text
            assert response.headers["content-type"] == "application/json"
            _retry_after(response)
            assert response.json() == {
                "error": "worker 0 holds 3 sessions, the limit (--max-sessions 3); delete "
                "finished sessions"
            }

        assert client.delete(f"/sessions/{child.json()['session_id']}").status_code == 204
        assert client.post("/sessions").status_code == 200
        _until(lambda: _worker(client)["rejected"]["max_sessions"] == 3, "rejections reported")
        assert 'sessiongate_rejected_total{worker="0",reason="max_sessions"} 3' in (
            client.get("/metrics").text
        )


def test_records_budget_refuses_turns_before_the_upstream(engine: ServerProcess) -> None:
    # In-process: the core's own /health. One R3 turn of this engine records ~6 KB, so a
    # 16 KiB budget takes a few turns to fill.
    budget = 16 * 1024
    with (
        _serve(engine, "--workers", "0", "--max-records-bytes", "16K") as gateway,
        httpx.Client(base_url=gateway.url, timeout=30) as client,
    ):
        session_id = client.post("/sessions").json()["session_id"]
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Start."}]
        recorded = 0
        while True:
            before = _engine_requests(engine)
            response = _turn(client, session_id, messages)
            if response.status_code != 200:
                break
            recorded += 1
            messages += [
                response.json()["choices"][0]["message"],
                {"role": "tool", "content": "ok"},
            ]
            assert recorded < 20, "the budget never filled"
        assert recorded >= 2
        assert response.status_code == 503, response.text
        _retry_after(response)
        error = response.json()["error"]
        assert error.startswith("records memory budget of the gateway is full (")
        assert error.endswith("--max-records-bytes); fetch and delete finished sessions")
        assert _engine_requests(engine) == before, "a refused turn reached the upstream"

        health = client.get("/health").json()
        assert health["max_records_bytes"] == budget
        assert health["records_bytes"] >= budget
        assert health["rejected"] == {"max_sessions": 0, "records_budget": 1}
        # A header session is not created just to be refused.
        sessions = health["sessions"]
        header_turn = client.post(
            "/v1/chat/completions",
            headers={"X-Session-ID": "late-agent"},
            json={"messages": [{"role": "user", "content": "hi"}]},
        )
        assert header_turn.status_code == 503
        assert client.get("/health").json()["sessions"] == sessions
        assert _engine_requests(engine) == before

        # Fetching and deleting is what frees the budget.
        document = client.get(f"/sessions/{session_id}").json()
        assert len(document["records"]) == recorded
        assert client.delete(f"/sessions/{session_id}").status_code == 204
        assert client.get("/health").json()["records_bytes"] == 0
        fresh = client.post("/sessions").json()["session_id"]
        assert _turn(client, fresh, [{"role": "user", "content": "Again."}]).status_code == 200

        metrics = client.get("/metrics").text
        assert f'sessiongate_records_bytes_limit{{worker="0"}} {budget}' in metrics
        assert 'sessiongate_rejected_total{worker="0",reason="records_budget"} 2' in metrics


def test_path_sessions_expire_after_the_ttl(engine: ServerProcess) -> None:
    with (
        _serve(engine, "--workers", "1", "--session-ttl", "0.5") as gateway,
        httpx.Client(base_url=gateway.url, timeout=30) as client,
    ):
        session_id = client.post("/sessions").json()["session_id"]
        assert _turn(client, session_id, [{"role": "user", "content": "hi"}]).status_code == 200
        # Watched through /health only: a request naming the session would keep it alive.
        _until(lambda: _worker(client)["sessions_expired"] == 1, "the session expired")
        assert _worker(client)["sessions"] == 0
        expected = {"error": f"session {session_id} expired after 0.5 s idle"}
        for response in (
            client.get(f"/sessions/{session_id}"),
            _turn(client, session_id, [{"role": "user", "content": "hi"}]),
            client.delete(f"/sessions/{session_id}"),
        ):
            assert response.status_code == 404
            assert response.json() == expected
        assert client.get("/sessions/" + "0" * 32).json()["error"].endswith("not found")
        assert 'sessiongate_sessions_expired_total{worker="0"} 1' in client.get("/metrics").text


def test_limits_show_per_worker_in_health_and_metrics(engine: ServerProcess) -> None:
    with (
        _serve(engine, "--workers", "2", "--session-ttl", "600") as gateway,
        httpx.Client(base_url=gateway.url, timeout=30) as client,
    ):
        # The default budget: half of this machine's memory, split over the two workers.
        budget = auto_records_bytes(2)
        session_id = client.post("/sessions").json()["session_id"]
        assert _turn(client, session_id, [{"role": "user", "content": "hi"}]).status_code == 200
        _until(
            lambda: sum(w["records_bytes"] for w in client.get("/health").json()["workers"]) > 0,
            "the recorded turn reported",
        )
        workers = client.get("/health").json()["workers"]
        for worker in workers:
            assert worker["max_sessions"] == 10_000
            assert worker["max_records_bytes"] == budget
            assert worker["session_ttl"] == 600
            assert worker["rejected"] == {"max_sessions": 0, "records_budget": 0}
        metrics = client.get("/metrics").text
        for worker in workers:
            index = worker["index"]
            assert f'sessiongate_sessions_limit{{worker="{index}"}} 10000' in metrics
            assert f'sessiongate_records_bytes_limit{{worker="{index}"}} {budget}' in metrics
            assert f'sessiongate_worker_records_bytes{{worker="{index}"}} ' in metrics
        assert sum(w["records_bytes"] > 0 for w in workers) == 1  # the session's own worker


# -- the core, in-process -------------------------------------------------------------------


def _core(engine: ServerProcess, **settings: Any) -> SessionCore:
    return SessionCore(
        load_tokenizer(None), EnginePool([engine.url]), SessionSettings(r3=True, **settings)
    )


async def _call(core: SessionCore, op: str, session_id: str | None = None, **body: Any) -> Any:
    reply: CoreReply = await core.handle(
        CoreRequest(
            op=op,
            session_id=session_id,
            path="/v1/chat/completions" if op == "chat" else "",
            method="POST",
            body=json.dumps(body).encode() if body else b"",
        )
    )
    return reply


def _held(core: SessionCore) -> int:
    """What the incremental count must equal: a full scan of every stored record."""
    return sum(record.size for session in core.sessions.values() for record in session.records)


def test_record_bytes_follow_commits_rollbacks_and_closes(engine: ServerProcess) -> None:
    async def scenario() -> None:
        core = _core(engine)
        try:
            first = json.loads((await _call(core, "create")).body)["session_id"]
            other = json.loads((await _call(core, "create")).body)["session_id"]
            user = {"role": "user", "content": "Count to three."}
            reply = await _call(core, "chat", first, messages=[user], max_tokens=8)
            assistant = json.loads(reply.body)["choices"][0]["message"]
            assert core.records_bytes == _held(core) > 0
            for follow_up in ("And to four.", "No: to five, slowly, with words."):
                # The second follow-up replaces the first: a one-step rollback.
                messages = [user, assistant, {"role": "user", "content": follow_up}]
                reply = await _call(core, "chat", first, messages=messages, max_tokens=8)
                assert reply.status == 200, reply.body
                assert len(core.sessions[first].records) == 2
                assert core.records_bytes == _held(core)
                assert core.sessions[first].records_bytes == core.sessions[first].recorded_bytes()
            await _call(core, "chat", other, messages=[user], max_tokens=8)
            assert core.records_bytes == _held(core)
            # A rollback to no checkpoint at all: the session's one record is replaced.
            fresh = {"role": "user", "content": "Something else entirely, please."}
            reply = await _call(core, "chat", other, messages=[fresh], max_tokens=8)
            assert reply.status == 200, reply.body
            assert len(core.sessions[other].records) == 1
            assert core.records_bytes == _held(core)
            kept = core.sessions[other].records_bytes
            assert (await _call(core, "delete", first)).status == 204
            assert core.records_bytes == _held(core) == kept
            assert (await _call(core, "delete", other)).status == 204
            assert core.records_bytes == 0
        finally:
            await core.aclose()

    asyncio.run(scenario())


def test_budget_and_cap_replies_carry_retry_after(engine: ServerProcess) -> None:
    async def scenario() -> None:
        core = _core(engine, max_sessions=1, max_records_bytes=1)
        try:
            session_id = json.loads((await _call(core, "create")).body)["session_id"]
            refused = await _call(core, "create")
            assert refused.status == 429 and ("retry-after", "5") in refused.headers
            user = {"role": "user", "content": "hi"}
            # Below the budget a turn goes ahead, even one whose reply passes it.
            assert (await _call(core, "chat", session_id, messages=[user])).status == 200
            assert core.records_bytes > 1
            full = await _call(core, "chat", session_id, messages=[user])
            assert full.status == 503 and ("retry-after", "5") in full.headers
            assert core.rejected == {"max_sessions": 1, "records_budget": 1}
        finally:
            await core.aclose()

    asyncio.run(scenario())


def test_expiry_keeps_a_bounded_record_of_expired_ids(
    engine: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(session_table, "EXPIRED_IDS_KEPT", 2)  # read where sessions expire
    ended: list[tuple[str, str]] = []

    async def scenario() -> None:
        # No background expiry here: the test moves the clock itself.
        core = _core(engine, session_ttl=30.0, header_session_ttl=0)
        core.table.end_hooks.append(lambda session_id, reason: ended.append((session_id, reason)))
        try:
            ids = [json.loads((await _call(core, "create")).body)["session_id"] for _ in range(3)]
            header = await core.handle(
                CoreRequest(
                    op="chat",
                    session_id="header-session",
                    body=json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(),
                    auto_create=True,
                )
            )
            assert header.status == 200
            assert await core.table.expire_idle(time.monotonic() + 10) == 0
            # Header sessions follow --header-session-ttl (off here), not --session-ttl.
            assert await core.table.expire_idle(time.monotonic() + 31) == 3
            assert list(core.sessions) == ["header-session"]
            assert ended == [(session_id, "expired") for session_id in ids]
            assert core.sessions_expired == 3
            assert list(core.table.expired_ids) == ids[1:]  # the oldest is forgotten
            gone = await _call(core, "get", ids[2])
            assert gone.status == 404
            assert json.loads(gone.body) == {"error": f"session {ids[2]} expired after 30 s idle"}
            forgotten = json.loads((await _call(core, "get", ids[0])).body)["error"]
            assert forgotten == f"session {ids[0]} not found"
        finally:
            await core.aclose()

    asyncio.run(scenario())


def test_limit_options_parse_and_forward() -> None:
    assert parse_size("0") == 0
    assert parse_size("1048576") == 1 << 20
    assert parse_size("8G") == parse_size("8GiB") == 8 << 30
    assert parse_size("1.5k") == 1536
    with pytest.raises(ValueError):
        parse_size("lots")

    def args(**values: Any) -> LimitsConfig:
        return LimitsConfig(**values)

    assert limit_settings(args()) == {
        "max_sessions": 10_000,
        "max_records_bytes": auto_records_bytes(1),
        "warm_records_bytes": 1 << 30,
        "session_ttl": 0.0,
    }
    assert limit_settings(args(warm_records_bytes="0"))["warm_records_bytes"] == 0
    # Local workers get their share of this machine as a number; Ray actors size themselves.
    assert limits_for_workers(args(), 4).max_records_bytes == str(auto_records_bytes(4))
    assert limits_for_workers(args(), None).max_records_bytes == AUTO
    assert limits_for_workers(args(max_records_bytes="2G"), None).max_records_bytes == str(2 << 30)
    for bad in (
        {"max_sessions": -1},
        {"session_ttl": -1.0},
        {"max_records_bytes": "x"},
        {"warm_records_bytes": "auto"},
    ):
        with pytest.raises(SystemExit):
            limit_settings(args(**bad))

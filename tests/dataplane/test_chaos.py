"""Faults under load, short: each case of `benches/stress/chaos.py` against real processes (mock
engine, `serve --workers 2`, the fault proxy), asserting statuses, liveness and that records
stay exact. Deadlines are generous on purpose: the bench measures, these prove behaviour.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches" / "stress"))
from chaos import (
    VICTIM,
    Rig,
    engine_restart,
    kill_worker,
    proxy_fault,
    run_case,
    shard_of,
    stop_worker_case,
)

from sessiongate.dataplane.router.shard_router import ShardRouter

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

SHORT = {"steady": 1.0, "sessions": 6, "turns": 4}
# A failed request must come back well before this; one that does not has hung.
FAIL_FAST_MS = 10_000
RECOVERY_S = 30.0


@pytest.fixture(scope="module")
def direct() -> Iterator[Rig]:
    with Rig(timeout=30) as rig:
        yield rig


@pytest.fixture(scope="module")
def proxied() -> Iterator[Rig]:
    with Rig(proxy=True, timeout=2) as rig:
        yield rig


def statuses(result: dict[str, Any], label: str) -> set[int]:
    return {int(s) for s in result["statuses"].get(label, {})}


def assert_records_exact(result: dict[str, Any]) -> None:
    assert result["violations"] == []
    assert result["sessions_checked"] > 0


def test_killed_worker_fails_fast_and_other_shard_sees_no_error(direct: Rig) -> None:
    result = asyncio.run(run_case(direct, kill_worker(direct, 0.5), affected=VICTIM, **SHORT))
    assert result["errors_other_shard"] == 0, result
    # In flight on the killed worker: 503; its sessions afterwards: 404 (lost with it).
    assert statuses(result, "affected") <= {200, 204, 404, 503}, result
    assert result["failed_max_ms"] < FAIL_FAST_MS, result
    assert result["recovery_s"] is not None and result["recovery_s"] < RECOVERY_S, result
    assert_records_exact(result)


def test_new_sessions_avoid_a_down_worker(direct: Rig) -> None:
    """Regression: a root id the router minted for a worker that is restarting got a 503;
    the router now mints ids for live workers only."""
    pid = direct.worker_pids()[VICTIM]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + RECOVERY_S
    while httpx.get(direct.url + "/health").status_code != 503:
        assert time.monotonic() < deadline, "the router never saw the worker die"
        time.sleep(0.005)
    # One kept-alive client: the ten creates take milliseconds, well inside the ~1 s the
    # worker needs to restart, so every id must have been minted for the live worker.
    with httpx.Client(base_url=direct.url) as client:
        created = [client.post("/sessions") for _ in range(10)]
    assert [r.status_code for r in created] == [200] * 10
    assert {shard_of(r.json()["session_id"]) for r in created} == {1 - VICTIM}
    for reply in created:
        httpx.delete(f"{direct.url}/sessions/{reply.json()['session_id']}")
    while httpx.get(direct.url + "/health").status_code != 200:
        assert time.monotonic() < deadline, "the worker did not come back"
        time.sleep(0.05)


def test_engine_restart_gives_502_and_sessions_stay_usable(direct: Rig) -> None:
    result = asyncio.run(run_case(direct, engine_restart(direct, 1.0), affected=None, **SHORT))
    seen = statuses(result, "all")
    assert 502 in seen and seen <= {200, 204, 502}, result
    assert result["failed_max_ms"] < FAIL_FAST_MS, result
    assert result["recovery_s"] is not None and result["recovery_s"] < RECOVERY_S, result
    # Turns failed mid-session, were retried after the restart, and the records hold exactly
    # the answered turns with token ids that only extend.
    assert_records_exact(result)


def test_stopped_worker_is_named_stalled_and_other_shard_unaffected(direct: Rig) -> None:
    result = asyncio.run(stop_worker_case(direct, stopped_for=3.0, **SHORT))
    assert result["stalled_named_after_s"] is not None, result
    assert set(result["health_during_stop"]) == {200}, result
    assert f"worker {VICTIM}" in result["health_reason"] and "stalled" in result["health_reason"]
    assert f'sessiongate_worker_stalled{{worker="{VICTIM}"}} 1' in result["metrics_stalled"]
    assert f'sessiongate_worker_stalled{{worker="{1 - VICTIM}"}} 0' in result["metrics_stalled"]
    assert result["errors_other_shard"] == 0, result
    # The stopped worker's requests wait and complete after SIGCONT: no error at all.
    assert statuses(result, "affected") <= {200, 204}, result
    assert result["recovery_s"] is not None and result["recovery_s"] < RECOVERY_S, result
    assert_records_exact(result)
    states = {w["index"]: w["state"] for w in httpx.get(direct.url + "/health").json()["workers"]}
    assert states == {0: "up", 1: "up"}


@pytest.mark.parametrize(
    ("mode", "status", "seconds"),
    [("reset", 502, 1.0), ("truncate", 502, 1.0), ("stall", 502, 2.5), ("http500", 500, 1.0)],
)
def test_upstream_faults_get_documented_statuses(
    proxied: Rig, mode: str, status: int, seconds: float
) -> None:
    result = asyncio.run(
        run_case(proxied, proxy_fault(proxied, mode, seconds), affected=None, **SHORT)
    )
    seen = statuses(result, "all")
    assert status in seen and seen <= {200, 204, status}, result
    assert result["faulted_requests"] > 0
    if mode == "stall":
        assert any("timed out" in e for e in result["error_samples"]), result
    # --timeout 2: even the stall answers long before a client would call it hung.
    assert result["failed_max_ms"] < FAIL_FAST_MS, result
    assert result["recovery_s"] is not None and result["recovery_s"] < RECOVERY_S, result
    assert_records_exact(result)


class _Channel:
    def __init__(self, index: int, *, up: bool, beat_age: float) -> None:
        self.index = index
        self.up = up
        self.last_heartbeat = time.monotonic() - beat_age


def test_new_root_ids_avoid_down_and_stalled_workers() -> None:
    router = ShardRouter(3)
    router.channels = [  # type: ignore[list-item]
        _Channel(0, up=False, beat_age=0.1),
        _Channel(1, up=True, beat_age=60.0),
        _Channel(2, up=True, beat_age=0.1),
    ]
    assert {router._owner(router._mint_session_id(b"")) for _ in range(50)} == {2}
    # With no worker placeable, an id is still minted (and its request fails as before).
    router.channels[2] = _Channel(2, up=False, beat_age=0.1)  # type: ignore[call-overload]
    assert router._mint_session_id(b"")

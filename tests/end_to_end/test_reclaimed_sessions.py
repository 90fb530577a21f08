"""A deleted session answers 410 Gone (not 404) through a real `serve`, in both layouts, and
after a restart with --records-dir; ids never seen stay 404; a session header naming a
deleted session does not start a new one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from support.procs import ServerProcess, free_port, mock_engine

pytestmark = pytest.mark.procs

HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    with mock_engine("--completion-tokens", "4") as proc:
        yield proc.url


def serve(engine: str, workers: int, *extra: str) -> ServerProcess:
    port = free_port()
    argv = ["serve", "--port", str(port), "--backend", engine, "--workers", str(workers)]
    return ServerProcess([*argv, *extra], port, timeout=60)


def turn(client: httpx.Client, sid: str) -> httpx.Response:
    return client.post(f"/sessions/{sid}/v1/chat/completions", json={"messages": HELLO})


@pytest.mark.parametrize("workers", [0, 2])
def test_a_deleted_session_is_gone_and_an_unknown_one_not_found(engine: str, workers: int) -> None:
    with serve(engine, workers) as proc, httpx.Client(base_url=proc.url, timeout=30) as client:
        sid = client.post("/sessions", json={}).json()["session_id"]
        assert turn(client, sid).status_code == 200
        assert client.delete(f"/sessions/{sid}").status_code == 204
        late = turn(client, sid)
        assert late.status_code == 410
        assert f"session {sid} was deleted" in late.json()["error"]
        for method, path in (("GET", f"/sessions/{sid}"), ("DELETE", f"/sessions/{sid}")):
            assert client.request(method, path).status_code == 410
        assert turn(client, "never-created").status_code == 404
        # A session header naming it does not start a new session under the same id.
        header = client.post(
            "/v1/chat/completions", json={"messages": HELLO}, headers={"X-Session-Id": sid}
        )
        assert header.status_code == 410
        fresh = client.post(
            "/v1/chat/completions", json={"messages": HELLO}, headers={"X-Session-Id": "fresh"}
        )
        assert fresh.status_code == 200


def test_tombstones_survive_a_restart_with_a_records_directory(engine: str, tmp_path: Path) -> None:
    records = ["--records-dir", str(tmp_path), "--reclaimed-ids", "2"]
    with serve(engine, 0, *records) as proc, httpx.Client(base_url=proc.url, timeout=30) as client:
        sids = [client.post("/sessions", json={}).json()["session_id"] for _ in range(3)]
        for sid in sids:
            assert turn(client, sid).status_code == 200
            assert client.delete(f"/sessions/{sid}").status_code == 204
    with serve(engine, 0, *records) as proc, httpx.Client(base_url=proc.url, timeout=30) as client:
        # The two newest are remembered (--reclaimed-ids 2); the oldest fell out: 404.
        assert [turn(client, sid).status_code for sid in sids] == [404, 410, 410]

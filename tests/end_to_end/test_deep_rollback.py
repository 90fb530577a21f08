"""Deep rollback (`--max-rollback-steps`, default 64) through a real `serve` and the mock
engine, in both layouts (in-process sessions, and sessions on worker processes): an agent
retrying from a checkpoint 64 assistant steps back is served, one step further is a 400
that changes nothing, the record says how deep the turn rolled back and `/health` counts it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sessiongate.demo.verify import trajectory_problems
from support.procs import ServerProcess, free_port, mock_engine

pytestmark = pytest.mark.procs

LIMIT = 64


@pytest.fixture(scope="module", params=[0, 2], ids=["workers0", "workers2"])
def gateway(request: pytest.FixtureRequest) -> Iterator[str]:
    with mock_engine("--completion-tokens", "4") as engine:
        port = free_port()
        argv = ["serve", "--port", str(port), "--backend", engine.url]
        argv += ["--workers", str(request.param)]
        with ServerProcess(argv, port, timeout=60) as proc:
            yield proc.url


def turn(client: httpx.Client, sid: str, messages: list[dict[str, Any]]) -> httpx.Response:
    return client.post(f"/sessions/{sid}/v1/chat/completions", json={"messages": messages})


def rollback_counters(document: dict[str, Any]) -> tuple[int, int]:
    """(rollbacks, rollback_steps) of /health: the core's, or summed over the workers."""
    if "workers" in document:
        workers = document["workers"]
        return sum(w["rollbacks"] for w in workers), sum(w["rollback_steps"] for w in workers)
    return document["rollbacks"], document["rollback_steps"]


def test_rollback_up_to_64_steps(gateway: str) -> None:
    with httpx.Client(base_url=gateway, timeout=30) as client:
        sid = client.post("/sessions", json={}).json()["session_id"]
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Start the task."}]
        for step in range(LIMIT + 1):
            reply = turn(client, sid, messages)
            assert reply.status_code == 200, reply.text
            messages.append(reply.json()["choices"][0]["message"])
            messages.append({"role": "tool", "content": f"result {step}"})
        before = client.get(f"/sessions/{sid}").json()
        health_before = rollback_counters(client.get("/health").json())
        # 65 steps back (to the first user message): one more than allowed.
        refused = turn(client, sid, [messages[0], {"role": "user", "content": "Start over."}])
        assert refused.status_code == 400
        assert f"roll back {LIMIT + 1} assistant steps, at most {LIMIT}" in refused.text
        assert client.get(f"/sessions/{sid}").json() == before
        # 64 steps back: retry the first tool result.
        retried = turn(client, sid, [*messages[:2], {"role": "tool", "content": "retried"}])
        assert retried.status_code == 200, retried.text
        after = client.get(f"/sessions/{sid}").json()
        # Workers report their counters with their heartbeats: wait for the next ones.
        deadline = time.monotonic() + 10
        while (health_after := rollback_counters(client.get("/health").json())) == health_before:
            assert time.monotonic() < deadline, "the rollback never reached /health"
            time.sleep(0.1)
    assert len(after["records"]) == 2
    assert after["records"][0] == before["records"][0]
    assert [r["rollback_steps"] for r in after["records"]] == [0, LIMIT]
    assert trajectory_problems(after) == []
    # The new prompt extends the first checkpoint (rebuilt from the last one's links).
    first = before["records"][0]
    checkpoint = first["request"]["input_ids"] + [
        t[1] for t in first["response"]["choices"][0]["meta_info"]["output_token_logprobs"]
    ]
    assert after["records"][1]["request"]["input_ids"][: len(checkpoint)] == checkpoint
    assert health_after[0] - health_before[0] == 1
    assert health_after[1] - health_before[1] == LIMIT


def test_a_deep_rollback_is_recovered_from_the_records_directory(tmp_path: Path) -> None:
    # Recovery replays each entry against the checkpoint it kept (store/records_store.py
    # replay_turn): a turn that kept the first of five checkpoints must rebuild from links.
    with mock_engine("--completion-tokens", "4") as engine:
        port = free_port()
        argv = ["serve", "--port", str(port), "--backend", engine.url, "--workers", "0"]
        argv += ["--records-dir", str(tmp_path)]
        with (
            ServerProcess(argv, port, timeout=60) as proc,
            httpx.Client(base_url=proc.url, timeout=30) as client,
        ):
            sid = client.post("/sessions", json={}).json()["session_id"]
            messages: list[dict[str, Any]] = [{"role": "user", "content": "Start."}]
            for step in range(5):
                reply = turn(client, sid, messages)
                messages.append(reply.json()["choices"][0]["message"])
                messages.append({"role": "tool", "content": f"result {step}"})
            retried = turn(client, sid, [*messages[:2], {"role": "tool", "content": "again"}])
            assert retried.status_code == 200, retried.text
            extended = [*messages[:2], {"role": "tool", "content": "again"}]
            extended += [retried.json()["choices"][0]["message"], {"role": "user", "content": "on"}]
            assert turn(client, sid, extended).status_code == 200
            before = client.get(f"/sessions/{sid}").json()
        with (
            ServerProcess(argv, port, timeout=60) as proc,
            httpx.Client(base_url=proc.url, timeout=30) as client,
        ):
            after = client.get(f"/sessions/{sid}").json()
    assert [r["rollback_steps"] for r in after["records"]] == [0, 4, 0]
    assert after["records"] == before["records"]
    assert after["metadata"]["accumulated_token_ids"] == before["metadata"]["accumulated_token_ids"]
    assert trajectory_problems(after) == []

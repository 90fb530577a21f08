"""Dialect turns in tree mode (`--session-mode tree`) and in session families, through a real
`serve`: an Anthropic Messages retry from an earlier turn branches the tree as a chat retry
does, and a child session (sub-agent) asked in the Responses dialect records under its own
id, its parent's family intact."""

from __future__ import annotations

import httpx
import pytest

from support.procs import ServerProcess, free_port, mock_engine

pytestmark = pytest.mark.procs


def test_dialect_turns_branch_trees_and_serve_child_sessions() -> None:
    with mock_engine("--completion-tokens", "6") as engine:
        port = free_port()
        argv = ["serve", "--port", str(port), "--backend", engine.url, "--workers", "0"]
        argv += ["--session-mode", "tree"]
        with (
            ServerProcess(argv, port, timeout=60) as proc,
            httpx.Client(base_url=proc.url, timeout=30) as client,
        ):
            sid = client.post("/sessions", json={}).json()["session_id"]
            path = f"/sessions/{sid}/v1/messages"
            history = [{"role": "user", "content": "Plan the task."}]
            first = client.post(path, json={"model": "m", "max_tokens": 8, "messages": history})
            assert first.status_code == 200, first.text
            text = "".join(b["text"] for b in first.json()["content"] if b["type"] == "text")
            step = [*history, {"role": "assistant", "content": text}]
            for follow_up in ("Go on.", "Try another way."):  # two children of turn 1
                reply = client.post(
                    path,
                    json={
                        "model": "m",
                        "max_tokens": 8,
                        "messages": [*step, {"role": "user", "content": follow_up}],
                    },
                )
                assert reply.status_code == 200, reply.text
            tree = client.get(f"/sessions/{sid}").json()
            child = client.post("/sessions", json={"parent_session_id": sid}).json()["session_id"]
            asked = client.post(
                f"/sessions/{child}/v1/responses",
                json={"model": "m", "input": "Sub-task.", "store": False},
            )
            assert asked.status_code == 200, asked.text
            parent = client.get(f"/sessions/{sid}").json()
            sub = client.get(f"/sessions/{child}").json()
            leaves = client.post(f"/sessions/{sid}/samples", json={})
    # GET shows the active path (the last leaf's): root, then the second follow-up.
    assert [r["dialect"] for r in tree["records"]] == ["anthropic"] * 2
    assert leaves.status_code == 200
    # Two leaves under the first turn: the retry branched instead of replacing it.
    nodes = tree["metadata"]["tree"]["nodes"]
    assert [node["parent"] for node in nodes] == [None, 0, 0]
    assert child in parent["metadata"]["child_session_ids"]
    assert sub["metadata"]["parent_session_id"] == sid
    assert [r["dialect"] for r in sub["records"]] == ["responses"]

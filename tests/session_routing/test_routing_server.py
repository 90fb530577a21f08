"""Session routing through the real server: what sessiongate sends upstream in every mode,
captured by the mock engine (headers and bodies), over two sessions x three turns plus a
child session, and finality over a tree whose final turn spawns a child."""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sessiongate.errors import BadRequest
from sessiongate.session_routing.stamper import branch_declaration, is_final_turn
from support.procs import ServerProcess, free_port

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs


@pytest.fixture(scope="module")
def engine() -> Iterator[ServerProcess]:
    port = free_port()
    with ServerProcess(["mock-engine", "--port", str(port)], port) as proc:
        yield proc


def run_tree(gateway: ServerProcess, engine: ServerProcess) -> list[dict[str, Any]]:
    """Two root sessions x three turns (the last marked final) plus one child session of the
    first root (two turns); returns the captured upstream requests in order, tagged."""
    captured: list[dict[str, Any]] = []
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        roots = [client.post("/sessions").json()["session_id"] for _ in range(2)]
        child = client.post("/sessions", json={"parent_session_id": roots[0]}).json()["session_id"]
        plan = [(roots[0], 3), (roots[1], 3), (child, 2)]
        for sid, turns in plan:
            messages: list[dict[str, Any]] = [{"role": "user", "content": f"start {sid}"}]
            for turn in range(turns):
                headers = {"X-Session-Final": "true"} if turn == turns - 1 else {}
                body = {
                    "messages": messages,
                    "max_tokens": 4,
                    "nvext": {"greed_sampling": True, "session_control": {"action": "x"}},
                }
                reply = client.post(
                    f"/sessions/{sid}/v1/chat/completions", json=body, headers=headers
                )
                assert reply.status_code == 200, reply.text
                log = httpx.get(engine.url + "/mock/requests", params={"last": 1}).json()
                captured.append(
                    {
                        "sid": sid,
                        "turn": turn,
                        "final": turn == turns - 1,
                        "headers": log["headers"][0],
                        "body": log["requests"][0],
                    }
                )
                messages.append(reply.json()["choices"][0]["message"])
                messages.append({"role": "tool", "content": "ok"})
    for entry in captured:
        entry["root"] = roots[0] if entry["sid"] in (roots[0], child) else roots[1]
        entry["parent"] = roots[0] if entry["sid"] == child else None
    return captured


def gateway_for(engine: ServerProcess, mode: str, *opts: str) -> ServerProcess:
    port = free_port()
    args = ["serve", "--port", str(port), "--workers", "2", "--backend", engine.url]
    args += ["--session-routing", mode]
    for opt in opts:
        args += ["--session-routing-opt", opt]
    return ServerProcess(args, port)


def test_dynamo_headers(engine: ServerProcess) -> None:
    with gateway_for(engine, "dynamo_headers") as gw:
        for entry in run_tree(gw, engine):
            headers = entry["headers"]
            assert headers["x-dynamo-session-id"] == entry["sid"]
            if entry["parent"]:
                assert headers["x-dynamo-parent-session-id"] == entry["parent"]
            else:
                assert "x-dynamo-parent-session-id" not in headers


def test_dynamo_nvext_binds_then_closes(engine: ServerProcess) -> None:
    with gateway_for(engine, "dynamo_nvext", "timeout_seconds=42") as gw:
        for entry in run_tree(gw, engine):
            nvext = entry["body"]["nvext"]
            assert nvext["greed_sampling"] is True, "the caller's other nvext keys survive"
            if entry["final"]:
                assert nvext["session_control"] == {"session_id": entry["sid"], "action": "close"}
            else:
                assert nvext["session_control"] == {
                    "session_id": entry["sid"],
                    "action": "bind",
                    "timeout": 42,
                }


def test_smg_routing_key_and_session_id_header(engine: ServerProcess) -> None:
    with gateway_for(engine, "smg_routing_key") as gw:
        for entry in run_tree(gw, engine):
            assert entry["headers"]["x-smg-routing-key"] == entry["sid"]
    with gateway_for(engine, "session_id_header", "header_name=X-Affinity") as gw:
        for entry in run_tree(gw, engine):
            assert entry["headers"]["x-affinity"] == entry["sid"]


def test_identity_headers(engine: ServerProcess) -> None:
    with gateway_for(
        engine, "identity_headers", "session=X-S,X-S2", "parent=X-P", "root=X-R"
    ) as gw:
        for entry in run_tree(gw, engine):
            headers = entry["headers"]
            assert headers["x-s"] == headers["x-s2"] == entry["sid"]
            assert headers["x-r"] == entry["root"]
            assert headers.get("x-p") == entry["parent"]


def test_bad_routing_configuration_fails_at_startup(engine: ServerProcess) -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "sessiongate",
            "serve",
            "--backend",
            engine.url,
            "--session-routing",
            "identity_headers",
            "--session-routing-opt",
            "session=X-A",
            "--session-routing-opt",
            "parent=x-a",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "X-A" in result.stderr or "x-a" in result.stderr


FIXTURE = Path(__file__).parent / "routing_plugin_fixture"


@pytest.fixture()
def plugin_env(tmp_path: Path) -> dict[str, str]:
    """An environment in which the fixture plugin is installed (a fake dist-info on the
    path: importlib.metadata's real entry-point discovery, no pip)."""
    project = tomllib.loads((FIXTURE / "pyproject.toml").read_text())["project"]
    info = tmp_path / "sg_routing_fixture-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: sg-routing-fixture\nVersion: 0.1.0\n"
    )
    points = project["entry-points"]["sessiongate.session_routing"]
    lines = ["[sessiongate.session_routing]", *(f"{k} = {v}" for k, v in points.items())]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    path = os.pathsep.join([str(tmp_path), str(FIXTURE / "src"), os.environ.get("PYTHONPATH", "")])
    return {"PYTHONPATH": path}


def test_finality_flags_over_a_tree_whose_final_turn_spawns(
    engine: ServerProcess, plugin_env: dict[str, str]
) -> None:
    port = free_port()
    args = ["serve", "--port", str(port), "--workers", "2", "--backend", engine.url]
    args += ["--session-routing", "fixture_context"]
    with ServerProcess(args, port, env=plugin_env) as gw, httpx.Client(base_url=gw.url) as client:

        def turn(sid: str, messages: list[dict[str, Any]], **headers: str) -> dict[str, Any]:
            reply = client.post(
                f"/sessions/{sid}/v1/chat/completions",
                json={"messages": messages, "max_tokens": 4},
                headers=headers,
            )
            assert reply.status_code == 200, reply.text
            log = httpx.get(engine.url + "/mock/requests", params={"last": 1}).json()
            context: dict[str, Any] = json.loads(log["headers"][0]["x-fixture-context"])
            messages.append(reply.json()["choices"][0]["message"])
            messages.append({"role": "tool", "content": "ok"})
            return context

        root = client.post("/sessions").json()["session_id"]
        root_messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
        first = turn(root, root_messages)
        assert first["is_final_turn"] is False and first["is_family_final"] is False
        assert first["is_parent_final"] is None and first["root_session_id"] == root
        # The root's final turn will spawn a child: final for the root, not for the tree.
        last = turn(root, root_messages, **{"X-Session-Final": "true", "X-Session-Branch": "1"})
        assert last["is_final_turn"] is True and last["is_family_final"] is False

        child = client.post("/sessions", json={"parent_session_id": root}).json()["session_id"]
        child_messages: list[dict[str, Any]] = [{"role": "user", "content": "sub"}]
        working = turn(child, child_messages)
        assert working["parent_session_id"] == root and working["is_parent_final"] is True
        assert working["is_family_final"] is False
        closing = turn(child, child_messages, **{"X-Dynamo-Session-Final": "true"})
        assert closing["is_final_turn"] is True and closing["is_family_final"] is True


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1", (True, 1)),
        ("3", (True, 3)),
        ("true", (True, None)),
        ("yes", (True, None)),
        ("0", (False, None)),
        ("false", (False, None)),
        ("", (False, None)),
    ],
)
def test_branch_header_values(value: str, expected: tuple[bool, int | None]) -> None:
    assert branch_declaration([("x-session-branch", value)]) == expected


def test_branch_header_rejects_garbage_and_final_headers_parse() -> None:
    with pytest.raises(BadRequest, match="X-Session-Branch"):
        branch_declaration([("X-Session-Branch", "-2")])
    assert is_final_turn([("X-Dynamo-Session-Final", "TRUE")])
    assert not is_final_turn([("X-Session-Final", "false")])
    assert not is_final_turn([])

"""Sessions driven the same way through every data-plane layout, for equivalence checks."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx

from sessiongate.config.launch import LAUNCH_ENV
from sessiongate.primitives import shard_index, shard_key
from support.procs import ServerProcess


def start_messages(tag: str = "") -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": f"Begin {tag}."},
    ]


def _equivalence_script(url: str, cover: int = 0) -> tuple[list[tuple[Any, ...]], set[int]]:
    """A deterministic script of creates, chats (tool turns, a child), GETs, DELETEs and
    errors; returns normalised (step, status, content type, body) and the workers used.
    Root ids are random, so the script's six sessions may all land on one worker; with
    `cover`, unrecorded extra sessions then chat until that many workers have served one."""
    volatile = re.compile(
        r'"(id|created|timestamp|request_timestamp|e2e_latency|response_sent_to_client_ts|session_id|parent_session_id)"'
        r':("[^"]*"|[0-9.e-]+)'
    )
    ids: dict[str, str] = {}
    steps: list[tuple[Any, ...]] = []
    owners: set[int] = set()
    with httpx.Client(base_url=url, timeout=30) as client:

        def record(step: str, response: httpx.Response) -> None:
            text = response.text
            # Longest first: a child id contains its root's id.
            for real in sorted(ids, key=len, reverse=True):
                text = text.replace(real, ids[real])
            text = volatile.sub(r'"\1":"*"', text)
            steps.append((step, response.status_code, response.headers.get("content-type"), text))

        workers = len(client.get("/health").json()["workers"])
        for n in range(6):
            created = client.post("/sessions")
            record(f"create {n}", created)
            sid = created.json()["session_id"]
            ids[sid] = f"S{n}"
            owners.add(shard_index(shard_key(sid), workers))
            messages = start_messages(str(n))
            for turn in range(3):
                reply = client.post(
                    f"/sessions/{sid}/v1/chat/completions",
                    json={"messages": messages, "max_tokens": 16, "seed": n},
                )
                record(f"chat {n}.{turn}", reply)
                messages.append(reply.json()["choices"][0]["message"])
                messages.append({"role": "tool", "content": f"result {n}.{turn}"})
                if turn == 0:
                    child = client.post("/sessions", json={"parent_session_id": sid})
                    record(f"child {n}", child)
                    cid = child.json()["session_id"]
                    ids[cid] = f"C{n}"
                    record(
                        f"child chat {n}",
                        client.post(
                            f"/sessions/{cid}/v1/chat/completions",
                            json={"messages": start_messages(f"child {n}"), "seed": n},
                        ),
                    )
            record(f"get {n}", client.get(f"/sessions/{sid}"))
            record(
                f"bad json {n}", client.post(f"/sessions/{sid}/v1/chat/completions", content=b"{")
            )
            record(
                f"deep rollback {n}",
                client.post(
                    f"/sessions/{sid}/v1/chat/completions",
                    json={"messages": [*messages[:3], {"role": "tool", "content": "rewrite"}]},
                ),
            )
            record(f"delete {n}", client.delete(f"/sessions/{sid}"))
            record(f"get deleted {n}", client.get(f"/sessions/{sid}"))
        record("unknown", client.get("/sessions/" + "0" * 32))
        record("unknown parent", client.post("/sessions", json={"parent_session_id": "f" * 32}))
        record("bad create", client.post("/sessions", content=b"[1]"))
        record("no route", client.get("/nope"))
        while len(owners) < cover:
            sid = client.post("/sessions").json()["session_id"]
            reply = client.post(
                f"/sessions/{sid}/v1/chat/completions",
                json={"messages": start_messages("cover"), "max_tokens": 4},
            )
            assert reply.status_code == 200, reply.text
            owners.add(shard_index(shard_key(sid), workers))
            assert client.delete(f"/sessions/{sid}").status_code == 204
    return steps, owners


def reply_dir_of(gateway: ServerProcess) -> Path | None:
    """The shared-memory directory of a gateway's file segments (dataplane/transport/
    reply_files.py), read from its children's launch documents; None without one."""
    assert gateway.proc is not None
    children = Path(f"/proc/{gateway.proc.pid}/task/{gateway.proc.pid}/children").read_text()
    for pid in children.split():
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        for entry in environ:
            if entry.startswith(LAUNCH_ENV.encode() + b"="):
                launch = json.loads(entry.split(b"=", 1)[1])
                if launch.get("reply_dir"):
                    return Path(launch["reply_dir"])
    return None

"""`serve --ray` on a private local Ray instance (started by serve itself, 2 CPUs on this
machine kind): worker actors serve sessions on both shards; a worker process killed, then a
worker actor killed, are both replaced by Ray's restart policy and the router follows the new
address; a clean stop leaves no process behind."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from sessiongate.primitives import shard_index, shard_key
from support.procs import ServerProcess, free_port
from support.tcp_workers import chat, eventually, health, sessions_on_each_shard

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

pytest.importorskip("ray", reason="Ray is not installed: pip install 'sessiongate[ray]'")


def _alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return not stat.rsplit(")", 1)[1].split()[0] == "Z"


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _group(pgid: int) -> list[int]:
    """Live processes of process group `pgid`."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def _workers(url: str) -> list[dict[str, Any]]:
    workers: list[dict[str, Any]] = health(url)[1]["workers"]
    return workers


def _replaced(url: str, index: int, old: dict[str, Any]) -> dict[str, Any] | None:
    status, body = health(url)
    worker = body["workers"][index]
    if status == 200 and worker["pid"] != old["pid"]:
        return dict(worker)
    return None


def test_serve_ray_places_workers_and_ray_restarts_them() -> None:
    port = free_port()
    cpus = "1" if (os.cpu_count() or 1) >= 2 else "0.5"
    ray_args = ["--ray", "--ray-address", "local", "--workers", "2", "--worker-num-cpus", cpus]
    gateway = ServerProcess(
        ["serve", "--port", str(port), *ray_args],
        port,
        timeout=180,  # Ray's start-up on 2 busy cores
    )
    seen_pids: set[int] = set()
    try:
        gateway.start()
        assert gateway.proc is not None
        pgid = gateway.proc.pid
        url = gateway.url
        first = _workers(url)
        assert [w["state"] for w in first] == ["up", "up"]
        assert all(w["address"] and w["transport"] == "tcp" for w in first)
        for sid in sessions_on_each_shard(url):
            assert chat(url, sid).status_code == 200

        # 1. The worker process dies: its actor ends itself, Ray restarts the actor, the
        #    router follows the new address.
        os.kill(first[1]["pid"], signal.SIGKILL)
        second = eventually(lambda: _replaced(url, 1, first[1]), "worker 1 replaced", 120)
        seen_pids |= {first[0]["pid"], first[1]["pid"], second["pid"]}
        fresh = sessions_on_each_shard(url)
        assert chat(url, fresh[1], "after worker kill").status_code == 200
        assert chat(url, fresh[0], "other shard").status_code == 200

        # 2. The actor process itself dies (as with ray.kill(no_restart=False)).
        actor = _parent(second["pid"])
        seen_pids.add(actor)
        os.kill(actor, signal.SIGKILL)
        third = eventually(lambda: _replaced(url, 1, second), "actor 1 restarted", 120)
        seen_pids |= {third["pid"], _parent(third["pid"])}
        newest = sessions_on_each_shard(url)[1]
        assert shard_index(shard_key(newest), 2) == 1
        assert chat(url, newest, "after actor kill").status_code == 200
        gone = httpx.get(f"{url}/sessions/{fresh[1]}")
        assert gone.status_code == 404 and "restarted" in gone.json()["error"]
        metrics = httpx.get(url + "/metrics").text
        assert "sessiongate_worker_restarts_total 2" in metrics

        # A clean stop takes the actors, their workers and the local Ray instance along.
        gateway.proc.send_signal(signal.SIGTERM)
        assert gateway.proc.wait(timeout=90) == 0, gateway.output()
        leftovers = eventually(
            lambda: not [p for p in seen_pids if _alive(p)] and not _group(pgid),
            "every process of the deployment exits",
            60,
        )
        assert leftovers
    finally:
        gateway.__exit__(None, None, None)
        for pid in seen_pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def test_serve_ray_fail_policy_exits_non_zero_and_leaves_nothing() -> None:
    port = free_port()
    cpus = "1" if (os.cpu_count() or 1) >= 2 else "0.5"
    ray_args = ["--ray", "--ray-address", "local", "--workers", "2", "--worker-num-cpus", cpus]
    gateway = ServerProcess(
        ["serve", "--port", str(port), *ray_args, "--on-worker-exit", "fail"], port, timeout=180
    )
    seen_pids: set[int] = set()
    try:
        gateway.start()
        assert gateway.proc is not None
        pgid = gateway.proc.pid
        workers = _workers(gateway.url)
        seen_pids |= {w["pid"] for w in workers} | {_parent(w["pid"]) for w in workers}
        os.kill(workers[0]["pid"], signal.SIGKILL)
        assert gateway.proc.wait(timeout=90) == 1, gateway.output()
        assert "Ray actor is dead" in gateway.output()
        eventually(
            lambda: not [p for p in seen_pids if _alive(p)] and not _group(pgid),
            "every process of the deployment exits",
            60,
        )
    finally:
        gateway.__exit__(None, None, None)
        for pid in seen_pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)

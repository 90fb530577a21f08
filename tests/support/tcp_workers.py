"""Remote TCP workers on loopback: a worker process, a router over them, and probes."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx

from sessiongate.primitives import shard_index, shard_key
from support.dataplane import start_messages
from support.procs import _STARTED, ServerProcess, free_port

SECRET = "test-secret-" + "0123456789abcdef" * 2


T = TypeVar("T")


class WorkerProcess(ServerProcess):
    """`sessiongate worker` on 127.0.0.1:port, ready once it prints its address."""

    def __init__(self, port: int, secret_file: Path, backend: str, *extra: str) -> None:
        args = ["worker", "--listen", f"127.0.0.1:{port}", "--secret-file", str(secret_file)]
        super().__init__([*args, "--backend", backend, *extra], port)
        self.endpoint = f"127.0.0.1:{port}"

    def start(self) -> WorkerProcess:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sessiongate", *self.args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            start_new_session=True,
        )
        _STARTED.append(self.proc)
        deadline = time.monotonic() + self.timeout
        while "sessiongate worker listening on" not in self.output():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"worker did not start:\n{self.output()}")
            time.sleep(0.05)
        return self


def eventually(check: Callable[[], T | None], what: str, timeout: float = 60.0) -> T:
    """Poll `check` until it returns something truthy (generous: no timing asserted)."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.1)


def router(
    secret_file: Path,
    *endpoints: str,
    extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> ServerProcess:
    port = free_port()
    # /metrics answers 200 as soon as the router runs, whatever the workers' state.
    return ServerProcess(
        [
            "serve",
            "--port",
            str(port),
            "--worker-endpoints",
            ",".join(endpoints),
            "--secret-file",
            str(secret_file),
            *extra,
        ],
        port,
        ready_path="/metrics",
        env=env,
    )


def health(url: str) -> tuple[int, dict[str, Any]]:
    response = httpx.get(url + "/health", timeout=5)
    return response.status_code, response.json()


def sessions_on_each_shard(url: str, shards: int = 2) -> list[str]:
    owners: dict[int, str] = {}
    while len(owners) < shards:
        sid = httpx.post(url + "/sessions").json()["session_id"]
        owners.setdefault(shard_index(shard_key(sid), shards), sid)
    return [owners[i] for i in range(shards)]


def chat(url: str, sid: str, tag: str = "") -> httpx.Response:
    return httpx.post(
        f"{url}/sessions/{sid}/v1/chat/completions",
        json={"messages": start_messages(tag), "max_tokens": 4},
        timeout=30,
    )

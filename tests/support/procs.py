"""Start sessiongate CLI processes on free loopback ports and always clean them up.

Every integration test goes through `ServerProcess`: it starts `python -m sessiongate ...`
in its own process group, waits for `/health`, and on exit (or test failure) sends SIGTERM
to the whole group, then SIGKILL after a grace period. `kill_all_started()` is called at the
end of the pytest session as a last resort so no orphan survives a crashed test.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import httpx

_STARTED: list[subprocess.Popen[bytes]] = []


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _terminate_group(proc: subprocess.Popen[bytes], grace: float = 5.0) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=grace)


def kill_all_started() -> None:
    for proc in _STARTED:
        _terminate_group(proc, grace=2.0)
    _STARTED.clear()


class ServerProcess:
    """`python -m sessiongate <args>` (or another `module`) listening on `port`, ready once
    `/health` answers 200."""

    def __init__(
        self,
        args: Sequence[str],
        port: int,
        *,
        ready_path: str = "/health",
        timeout: float = 30.0,
        env: dict[str, str] | None = None,
        python: str = sys.executable,
        module: str = "sessiongate",
    ) -> None:
        self.args = list(args)
        # `python -m <module>`: sessiongate, or a test engine (support.replay_engine).
        self.module = module
        # Another checkout's interpreter (a venv of a reference commit) for A/B benchmarks.
        self.python = python
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.ready_path = ready_path
        self.timeout = timeout
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="sessiongate-test-", suffix=".log")

    def start(self) -> ServerProcess:
        cmd = [self.python, "-m", self.module, *self.args]
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            start_new_session=True,
        )
        _STARTED.append(self.proc)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{cmd} exited with {self.proc.returncode} before ready:\n{self.output()}"
                )
            try:
                if httpx.get(self.url + self.ready_path, timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{cmd} not ready after {self.timeout}s:\n{self.output()}")

    def output(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        _terminate_group(self.proc)
        if self.proc in _STARTED:
            _STARTED.remove(self.proc)
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        self._log.close()


def mock_engine(*args: str, timeout: float = 30.0) -> ServerProcess:
    """`sessiongate mock-engine <args>` on a free port (start it with `with`)."""
    port = free_port()
    return ServerProcess(["mock-engine", "--port", str(port), *args], port, timeout=timeout)

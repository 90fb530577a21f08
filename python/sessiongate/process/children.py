"""Child processes of a sessiongate process: spawned (never forked), never orphaned.

Children get `SESSIONGATE_PARENT_PID`; sessiongate subcommands that see it ask the kernel to
signal them when the parent dies (PR_SET_PDEATHSIG), so even a SIGKILLed parent leaves
nothing behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import httpx

PARENT_PID_ENV = "SESSIONGATE_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def listen_problem(host: str, port: int) -> str | None:
    """Why a server could not listen on `host:port` right now, or None when it could.

    Binds a throwaway socket the way uvicorn does (SO_REUSEADDR, so a port in TIME_WAIT counts
    as free), which tells "another process listens there" apart from a mere HTTP answer on it.
    """
    if port == 0:
        return None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        return f"cannot listen on {host}:{port}: {exc}"
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"port {port} is in use on {host} (another process is listening on it)"
            return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None


def listening_socket(host: str, port: int, backlog: int) -> socket.socket:
    """A non-blocking listening socket on the first address `host` resolves to, with
    SO_REUSEADDR so a restarted process can take its port back at once."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def die_with_parent() -> bool:
    """Called early by a child: ask Linux for SIGTERM when the parent dies.

    Returns False when the parent is already gone (we were re-parented before prctl).
    """
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent or not parent.isdigit():
        return True
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    return os.getppid() == int(parent)


def wait_http_ready(
    url: str, *, timeout: float, proc: subprocess.Popen[bytes] | None = None
) -> None:
    deadline = time.monotonic() + timeout
    last_error = "no answer"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"child exited with code {proc.returncode} before {url} was ready")
        try:
            response = httpx.get(url, timeout=1.0)
            if response.status_code == 200:
                return
            last_error = f"status {response.status_code}"
        except httpx.HTTPError as exc:
            last_error = f"{type(exc).__name__}: {exc}"
        time.sleep(0.05)
    raise RuntimeError(f"{url} not ready after {timeout:.0f}s ({last_error})")


class ChildProcess:
    """`python -m sessiongate <args>` as a child that dies with us."""

    def __init__(self, name: str, args: Sequence[str]) -> None:
        self.name = name
        self.args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ChildProcess:
        env = {**os.environ, PARENT_PID_ENV: str(os.getpid())}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sessiongate", *self.args],
            env=env,
            stdin=subprocess.DEVNULL,
        )
        return self

    def stop(self, grace: float = 5.0) -> int | None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return None if proc is None else proc.returncode
        proc.terminate()
        try:
            return proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait(timeout=grace)

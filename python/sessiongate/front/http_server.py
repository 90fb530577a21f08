"""Running an ASGI app under uvicorn the way every sessiongate process does.

SIGTERM and SIGINT request a graceful shutdown and the process then exits 0 (uvicorn alone
would re-raise the signal and die by it); the parent-death watch ends orphaned children.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from collections.abc import Callable, Generator
from types import FrameType
from typing import Any

import uvicorn

from sessiongate.process.children import PARENT_PID_ENV

_PARENT_POLL_S = 0.5


class QuietServer(uvicorn.Server):
    """uvicorn's Server that does not re-raise the signal it caught; `on_exit` hooks shutdown."""

    on_exit: Callable[[], object] | None = None  # what it returns is ignored

    def request_exit(self) -> None:
        self.should_exit = True
        if self.on_exit is not None:
            self.on_exit()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        def on_signal(sig: int, frame: FrameType | None) -> None:
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True  # second Ctrl-C: stop waiting for connections
            self.request_exit()

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def uvicorn_config(
    app: Any,
    host: str,
    port: int,
    log_level: str,
    http: type[asyncio.Protocol] | str = "auto",
) -> uvicorn.Config:
    """`http`: the gateway passes `http_protocol.gateway_protocol(...)` (read timeouts, JSON
    errors); "auto" picks httptools when installed, else h11."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        loop="asyncio",
        http=http,
        lifespan="off",
        timeout_graceful_shutdown=1,
    )


def parent_pid() -> int | None:
    raw = os.environ.get(PARENT_PID_ENV)
    return int(raw) if raw and raw.isdigit() else None


def bound_port(server: uvicorn.Server, default: int) -> int:
    sockets = [sock for srv in server.servers for sock in srv.sockets]
    port: int = sockets[0].getsockname()[1] if sockets else default
    return port


async def serve_until_exit(
    server: QuietServer,
    *,
    on_started: Callable[[int], None] | None = None,
    default_port: int = 0,
    sockets: list[socket.socket] | None = None,
) -> int:
    """Serve until signalled (or orphaned); 0 on a clean stop, uvicorn's code if it failed.
    `sockets=[]`: uvicorn listens on nothing (the compiled front hands it connections)."""

    async def quietly() -> int:
        try:
            await server.serve(sockets=sockets)
        except SystemExit as exc:  # uvicorn exits this way when it cannot bind; it logged why
            return exc.code if isinstance(exc.code, int) else 1
        return 0

    parent = parent_pid()
    task = asyncio.create_task(quietly())
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if server.started and on_started is not None:
        on_started(bound_port(server, default_port))
    while not task.done():
        # Belt and braces next to PDEATHSIG (non-Linux, or a reaper that re-parents us).
        if parent is not None and os.getppid() != parent and not server.should_exit:
            server.request_exit()
        await asyncio.wait({task}, timeout=_PARENT_POLL_S)
    return task.result()

"""The supervisor: spawns N workers and the router (never forks), waits until `/health` is
ready, watches every child, restarts a lost worker (or fails fast), and shuts everything
down cleanly on SIGINT/SIGTERM. Children die with it (PR_SET_PDEATHSIG), so even a killed
supervisor leaves nothing behind.

With remote workers (`serve --worker-endpoints`, `serve --ray`) it spawns only the router;
an `EndpointSource` (Ray placement) may report workers that moved, which it hands to the
router over the control socket.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Protocol

import httpx

from sessiongate.config.gateway import GatewayConfig
from sessiongate.config.launch import RouterLaunch, WorkerLaunch, launch_env
from sessiongate.dataplane.transport.reply_files import make_reply_dir, remove_reply_dir
from sessiongate.process.children import PARENT_PID_ENV, listen_problem
from sessiongate.protocol import INSTANCE_ENV, INSTANCE_HEADER

logger = logging.getLogger(__name__)

# More restarts than this within the window means the worker cannot stay up: fail instead.
RESTART_BURST = 5
RESTART_WINDOW_S = 30.0


class EndpointSource(Protocol):
    """Where remote workers are (Ray placement): polled by the supervisor's loop."""

    def changes(self) -> list[tuple[int, str]]:
        """(worker index, new HOST:PORT) since the last call; never blocks."""
        ...

    def failure(self) -> str | None:
        """Why a worker is gone for good, else None."""
        ...


@dataclass
class SupervisorConfig:
    workers: int  # local worker processes; 0 when the router is given remote endpoints
    # The router's launch (its descriptors are filled in at spawn) and each local worker's
    # configuration (None without local workers).
    router: RouterLaunch
    worker_config: GatewayConfig | None
    on_worker_exit: str = "restart"  # or "fail"
    ready_timeout: float = 60.0
    # Other children (the embedded mock engine) whose exit stops the server.
    watched: list[subprocess.Popen[bytes]] = field(default_factory=list)
    # Extra environment of the router (the Ray workers' shared secret).
    router_env: dict[str, str] = field(default_factory=dict)
    endpoint_source: EndpointSource | None = None
    # False for standalone remote workers, which may come up in any order and later: the
    # router answering /health at all (200 or 503) then counts as ready.
    require_workers_ready: bool = True

    @property
    def host(self) -> str:
        return self.router.config.listen.host

    @property
    def port(self) -> int:
        return self.router.config.listen.port


@dataclass
class _Worker:
    index: int
    generation: int
    proc: subprocess.Popen[bytes]
    restarts: deque[float] = field(default_factory=deque)


def _spawn(
    args: Sequence[str], pass_fds: Sequence[int], env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    child_env = {**os.environ, **(env or {}), PARENT_PID_ENV: str(os.getpid())}
    return subprocess.Popen(
        [sys.executable, "-m", "sessiongate", *args],
        pass_fds=tuple(pass_fds),
        env=child_env,
        stdin=subprocess.DEVNULL,
    )


class Supervisor:
    def __init__(self, config: SupervisorConfig) -> None:
        self.config = config
        self.workers: list[_Worker] = []
        self.router: subprocess.Popen[bytes] | None = None
        self._control: socket.socket | None = None
        self._stop_signal: int | None = None
        self._moves: dict[int, deque[float]] = {}
        # Per-run token the router echoes on /health: readiness must be proven by our router,
        # not by whatever else answers on the port (another gateway, a stale process).
        self.instance = secrets.token_hex(16)
        self._foreign_answer = False
        # Shared memory for the workers' bulk replies to the router (made at start, removed
        # at stop; transport/reply_files.py). None: frames only.
        self.reply_dir: str | None = None

    # -- children ---------------------------------------------------------------------

    def _spawn_worker(
        self, index: int, generation: int
    ) -> tuple[subprocess.Popen[bytes], socket.socket]:
        """A worker on a fresh socketpair; returns it and the router's end of the pair."""
        router_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        assert self.config.worker_config is not None
        launch = WorkerLaunch(
            self.config.worker_config, worker_end.fileno(), index, generation, self.reply_dir
        )
        try:
            proc = _spawn(["_worker"], [worker_end.fileno()], launch_env(launch))
        finally:
            worker_end.close()
        return proc, router_end

    def start(self) -> None:
        if self.config.workers and self.config.router.config.workers.shared_memory_replies:
            self.reply_dir = make_reply_dir()
        router_ends: list[socket.socket] = []
        for index in range(self.config.workers):
            proc, router_end = self._spawn_worker(index, 0)
            self.workers.append(_Worker(index, 0, proc))
            router_ends.append(router_end)
        control_here, control_router = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._control = control_here
        fds = [s.fileno() for s in router_ends]
        launch = dataclasses.replace(
            self.config.router,
            control_fd=control_router.fileno(),
            worker_fds=tuple(fds),
            reply_dir=self.reply_dir,
        )
        env = {**self.config.router_env, INSTANCE_ENV: self.instance, **launch_env(launch)}
        self.router = _spawn(["_router"], [*fds, control_router.fileno()], env)
        for sock in (*router_ends, control_router):
            sock.close()

    def _restart_worker(self, worker: _Worker) -> bool:
        now = time.monotonic()
        worker.restarts.append(now)
        while worker.restarts and now - worker.restarts[0] > RESTART_WINDOW_S:
            worker.restarts.popleft()
        if len(worker.restarts) > RESTART_BURST:
            logger.error(
                "worker %d exited %d times in %.0fs; giving up",
                worker.index,
                len(worker.restarts),
                RESTART_WINDOW_S,
            )
            return False
        generation = worker.generation + 1
        proc, router_end = self._spawn_worker(worker.index, generation)
        try:
            assert self._control is not None
            notice = json.dumps({"worker": worker.index, "generation": generation}).encode()
            notice += b"\n"
            socket.send_fds(self._control, [notice], [router_end.fileno()])
        except OSError as exc:
            logger.error("cannot hand worker %d's channel to the router: %s", worker.index, exc)
            proc.terminate()
            return False
        finally:
            router_end.close()
        worker.proc, worker.generation = proc, generation
        print(
            f"sessiongate: worker {worker.index} restarted "
            f"(pid {proc.pid}, generation {generation})",
            file=sys.stderr,
            flush=True,
        )
        return True

    def _move_worker(self, index: int, endpoint: str) -> bool:
        """Tell the router a remote worker's new address; False when it moves too often."""
        now = time.monotonic()
        moves = self._moves.setdefault(index, deque())
        moves.append(now)
        while moves and now - moves[0] > RESTART_WINDOW_S:
            moves.popleft()
        if len(moves) > RESTART_BURST:
            logger.error(
                "worker %d restarted %d times in %.0fs; giving up",
                index,
                len(moves),
                RESTART_WINDOW_S,
            )
            return False
        try:
            assert self._control is not None
            notice = json.dumps({"worker": index, "endpoint": endpoint}).encode() + b"\n"
            self._control.sendall(notice)
        except OSError as exc:
            logger.error("cannot hand worker %d's new address to the router: %s", index, exc)
            return False
        print(
            f"sessiongate: worker {index} is now at {endpoint} (its Ray actor was restarted)",
            file=sys.stderr,
            flush=True,
        )
        return True

    def stop(self, grace: float = 5.0) -> None:
        procs = [p for p in [self.router, *(w.proc for w in self.workers)] if p is not None]
        # Router first: stop taking requests, then the workers.
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + grace
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._control is not None:
            self._control.close()
        remove_reply_dir(self.reply_dir)

    # -- main loop --------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stop_signal = signum

    def run(self, on_ready: str | None = None) -> int:
        """Start everything, serve until signalled; the exit code."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            # Fail before spawning anything when the port is taken: the router could not
            # bind it, and the message says why (the router's exit code alone would not).
            problem = listen_problem(self.config.host, self.config.port)
            if problem is not None:
                print(f"sessiongate: {problem}", file=sys.stderr, flush=True)
                return 1
            self.start()
            return self._watch(on_ready)
        finally:
            self.stop()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _ready(self) -> bool:
        url = f"http://{self.config.host}:{self.config.port}/health"
        try:
            response = httpx.get(url, timeout=1.0)
        except httpx.HTTPError:
            return False
        if response.headers.get(INSTANCE_HEADER) != self.instance:
            self._foreign_answer = True  # someone else answers on our port
            return False
        return response.status_code == 200 or not self.config.require_workers_ready

    def _watch(self, on_ready: str | None) -> int:
        """Watch every child; until the first ready /health also enforce the ready timeout."""
        ready = False
        deadline = time.monotonic() + self.config.ready_timeout
        while self._stop_signal is None:
            assert self.router is not None
            if self.router.poll() is not None:
                # Lost the race for the port after the check in run(): say so plainly.
                problem = None if ready else listen_problem(self.config.host, self.config.port)
                if problem is None and self._foreign_answer:
                    problem = f"another process answers on port {self.config.port}"
                print(
                    f"sessiongate: router exited with code {self.router.returncode}"
                    + (f" ({problem})" if problem else "")
                    + "; stopping",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
            for other in self.config.watched:
                if other.poll() is not None:
                    print(
                        f"sessiongate: child {other.args!r} exited with code {other.returncode}",
                        file=sys.stderr,
                        flush=True,
                    )
                    return 1
            for worker in self.workers:
                code = worker.proc.poll()
                if code is None:
                    continue
                print(
                    f"sessiongate: worker {worker.index} (pid {worker.proc.pid}) exited with code "
                    f"{code}",
                    file=sys.stderr,
                    flush=True,
                )
                if self.config.on_worker_exit == "fail" or not self._restart_worker(worker):
                    return 1
            source = self.config.endpoint_source
            if source is not None:
                failure = source.failure()
                if failure is not None:
                    print(f"sessiongate: {failure}; stopping", file=sys.stderr, flush=True)
                    return 1
                for index, endpoint in source.changes():
                    if self.config.on_worker_exit == "fail" or not self._move_worker(
                        index, endpoint
                    ):
                        return 1
            if not ready:
                ready = self._ready()
                if ready and on_ready:
                    print(on_ready, flush=True)
                elif not ready and time.monotonic() > deadline:
                    print(
                        f"sessiongate: /health not ready after {self.config.ready_timeout:.0f}s",
                        file=sys.stderr,
                        flush=True,
                    )
                    return 1
            time.sleep(0.05)
        return 0

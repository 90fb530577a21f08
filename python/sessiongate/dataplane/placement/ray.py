"""Ray placement of the session workers (`sessiongate serve --ray`).

Each worker is a Ray actor that starts a TCP session worker on its node (`sessiongate
_worker` with the resolved configuration in its environment, listening on the node's IP,
port chosen by the kernel, secret passed by environment: what `sessiongate worker` runs) and
reports the address. Ray's own restart policy (`max_restarts`) brings back an actor that
died; the actor also ends itself when its worker process exits, so both failures look the
same to Ray. The supervisor polls every actor for its current address and hands changes to
the router over the control socket (`{"worker": i, "endpoint": "HOST:PORT"}`); the router
then reconnects to the new address. `ray` is imported only here, and only with `--ray`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import subprocess
import sys
import threading
import time
from typing import Any

from sessiongate.config.gateway import GatewayConfig
from sessiongate.config.launch import WorkerLaunch, launch_env
from sessiongate.dataplane.transport.tcp import SECRET_ENV, Endpoint
from sessiongate.process.children import PARENT_PID_ENV

logger = logging.getLogger(__name__)

READY_PREFIX = "sessiongate worker listening on "
POLL_INTERVAL_S = 0.5
# An actor that keeps answering "died" for this long is dead for good (not restarting).
DEAD_AFTER_S = 3.0


class WorkerActor:
    """The body of one worker actor (wrapped by `ray.remote` at run time)."""

    def __init__(self, index: int, config: dict[str, Any], secret: str) -> None:
        import ray

        host = ray.util.get_node_ip_address()
        # A TCP worker on this node (`_worker` without a channel descriptor), as
        # `sessiongate worker` would run with this configuration.
        worker = GatewayConfig.from_dict(config)
        workers = dataclasses.replace(
            worker.workers, listen=str(Endpoint(host, 0)), secret_env=SECRET_ENV
        )
        launch = WorkerLaunch(worker.replace(workers=workers), fd=None, index=index)
        env = {
            **os.environ,
            **launch_env(launch),
            SECRET_ENV: secret,
            PARENT_PID_ENV: str(os.getpid()),
        }
        # Ray runs actor methods on the process's main thread, which lives as long as the
        # actor: the child's PDEATHSIG (tied to the creating thread) fires only with it.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sessiongate", "_worker"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith(READY_PREFIX):
            self.proc.kill()
            raise RuntimeError(
                f"sessiongate worker {index} did not start on {host} (exit code "
                f"{self.proc.wait()}, output {line!r}); see the actor's log for its stderr"
            )
        self.index = index
        self.endpoint = line[len(READY_PREFIX) :].split()[0]
        self._stopping = False
        threading.Thread(target=self._follow, name="worker-output", daemon=True).start()

    def _follow(self) -> None:
        """Forward the worker's output; when it exits, end the actor so Ray restarts it (an
        actor without its worker would only report a dead address)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            sys.stdout.write(line)
        code = self.proc.wait()
        if self._stopping:
            return
        print(
            f"sessiongate worker {self.index} exited with code {code}; ending its actor so "
            "that Ray restarts it",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    def address(self) -> str:
        return self.endpoint

    def describe(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "actor_pid": os.getpid(), "worker_pid": self.proc.pid}

    def stop(self) -> None:
        """Stop the worker gracefully (the actor is killed right after)."""
        self._stopping = True
        self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise SystemExit(
            f"sessiongate serve --ray needs Ray: pip install 'sessiongate[ray]' ({exc})"
        ) from None
    return ray


class RayPlacement:
    """N worker actors in a Ray cluster, and the poller that follows their addresses."""

    def __init__(
        self,
        count: int,
        worker_config: GatewayConfig,
        *,
        address: str | None = None,
        num_cpus: float = 1.0,
        restart: bool = True,
        start_timeout: float = 120.0,
    ) -> None:
        self.count = count
        self.worker_config = worker_config
        self.address = address
        self.num_cpus = num_cpus
        self.restart = restart
        self.start_timeout = start_timeout
        # Generated per deployment; reaches the actors through Ray (the trust domain).
        self.secret = secrets.token_hex(32)
        self.endpoints: list[str] = []
        self.actors: list[Any] = []
        self._ray: Any = None
        self._lock = threading.Lock()
        self._changes: list[tuple[int, str]] = []
        self._failure: str | None = None
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None

    def start(self) -> list[str]:
        """Connect to (or start) Ray, create the actors, return their addresses in order."""
        ray = self._ray = import_ray()
        ray.init(
            address=self.address,
            namespace="sessiongate",
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=False,
        )
        actor_class = ray.remote(WorkerActor)
        self.actors = [
            actor_class.options(
                num_cpus=self.num_cpus,
                max_restarts=-1 if self.restart else 0,
                max_task_retries=0,
                # One worker per node where the cluster allows: the point is more CPUs.
                scheduling_strategy="SPREAD",
            ).remote(index, self.worker_config.to_dict(), self.secret)
            for index in range(self.count)
        ]
        refs = [actor.address.remote() for actor in self.actors]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=self.start_timeout)
        if pending:
            raise SystemExit(
                f"sessiongate serve --ray: {len(pending)} of {self.count} worker actors not "
                f"started after {self.start_timeout:.0f} s (each asks for {self.num_cpus:g} "
                f"CPU; available: {ray.available_resources().get('CPU', 0):g})"
            )
        try:
            self.endpoints = [str(endpoint) for endpoint in ray.get(refs)]
        except ray.exceptions.RayError as exc:
            raise SystemExit(f"sessiongate serve --ray: a worker actor failed: {exc}") from None
        self._poller = threading.Thread(target=self._poll, name="ray-poller", daemon=True)
        self._poller.start()
        return list(self.endpoints)

    # -- what the supervisor reads (EndpointSource) -------------------------------------

    def changes(self) -> list[tuple[int, str]]:
        with self._lock:
            changes, self._changes = self._changes, []
        return changes

    def failure(self) -> str | None:
        return self._failure

    # -- poller -------------------------------------------------------------------------

    def _poll(self) -> None:
        ray = self._ray
        pending: dict[int, Any] = {}
        died_since: dict[int, float] = {}
        while not self._stop.wait(POLL_INTERVAL_S):
            for index, actor in enumerate(self.actors):
                ref = pending.get(index)
                if ref is None:
                    pending[index] = actor.address.remote()
                    continue
                ready, _ = ray.wait([ref], timeout=0)
                if not ready:
                    continue  # a restarting actor answers once its worker is up
                del pending[index]
                try:
                    endpoint = str(ray.get(ref))
                except ray.exceptions.ActorUnavailableError:
                    died_since.pop(index, None)  # restarting, not dead
                    continue
                except ray.exceptions.RayActorError as exc:
                    first = died_since.setdefault(index, time.monotonic())
                    if time.monotonic() - first > DEAD_AFTER_S and not self._stop.is_set():
                        self._failure = f"worker {index}'s Ray actor is dead: {exc}"
                    continue
                died_since.pop(index, None)
                if endpoint != self.endpoints[index]:
                    self.endpoints[index] = endpoint
                    with self._lock:
                        self._changes.append((index, endpoint))

    def stop(self) -> None:
        self._stop.set()
        ray = self._ray
        if ray is None:
            return
        if self._poller is not None:
            self._poller.join(timeout=5)
        with contextlib.suppress(Exception):
            ray.wait(
                [actor.stop.remote() for actor in self.actors],
                num_returns=len(self.actors),
                timeout=10,
            )
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        # Stops the local instance if `start` created one; only disconnects otherwise.
        ray.shutdown()

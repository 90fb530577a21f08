"""The compiled front door: the Rust HTTP server in `sessiongate._core` owns the public
socket and
- answers stateless proxy requests itself (client -> upstream -> client, no Python on the
  path);
- passes the gateway's other requests (session turns, session API, /health, /metrics) to
  this process's event loop as parsed requests, answered by the same `GatewayApp.respond`
  the ASGI server calls (front/dispatched.py), the connection staying with it;
- hands the rest (other methods, the documentation pages, chunked or `Expect` bodies,
  HTTP/1.0, anything malformed), with the bytes it already read, to this process's uvicorn
  server, which serves the connection exactly as if it had accepted it.

Why no second hop: a session turn then costs one Python event loop and no HTTP server in
Python, while the stateless path, which is pure bytes, runs on tokio threads
(docs/performance.md, "The compiled front"). The routing decision is
`front/routes.py::front_decision`, twinned by `rust/front/route.rs`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import uvicorn

from sessiongate.config.engines import EngineRoutingConfig, ReliabilityConfig
from sessiongate.config.gateway import GatewayConfig
from sessiongate.engines.policy.base import LoadReport
from sessiongate.engines.registry import same_engine
from sessiongate.front.asgi import FrontendSettings, GatewayApp
from sessiongate.front.dispatched import DispatchedRequests
from sessiongate.front.http_server import QuietServer, serve_until_exit
from sessiongate.process.children import listening_socket

logger = logging.getLogger(__name__)

# uvicorn's default idle time of a kept-alive connection (`timeout_keep_alive`).
KEEPALIVE_TIMEOUT_S = 5.0
# Upstream connect timeout, as the Python upstream client's (engines/client.py).
CONNECT_TIMEOUT_S = 10.0
# A listen backlog for bursts of new connections (a load driver opening hundreds at once).
LISTEN_BACKLOG = 2048
# How long stop() lets requests the front is serving finish (uvicorn's graceful timeout).
STOP_GRACE_S = 1.0


@dataclass(frozen=True)
class FrontOptions:
    """What the front needs beyond the HTTP front-end settings."""

    engine_urls: Sequence[str]
    upstream_timeout: float
    threads: int
    # The bounds of the request-duration histogram the front fills (the metrics' buckets).
    latency_buckets: Sequence[float]
    # The health path the process's prober (the engine registry's) checks for the front.
    health_path: str = "/health"
    # How stateless requests choose an engine (`--policy`; round robin by default).
    engine_routing: EngineRoutingConfig = field(default_factory=EngineRoutingConfig)
    # Health thresholds, retries and the circuit breaker of the relay (--retry-*, --cb-*).
    reliability: ReliabilityConfig = field(default_factory=ReliabilityConfig)


def default_front_threads() -> int:
    # Two cover a router process next to engine and workers on a small machine; past four,
    # one process's accept loop and the upstream keep-alive pools are not the limit.
    return max(1, min(os.cpu_count() or 1, 4))


def front_unsupported(engine_urls: Sequence[str], *, registered: bool = False) -> str | None:
    """Why the compiled front cannot serve this configuration, or None. `registered`: the
    engines register at run time (`--backend none`), so none known yet is fine."""
    if not engine_urls and not registered:
        return "the router does not know the engines (its workers do)"
    https = [url for url in engine_urls if not url.startswith("http://")]
    if https:
        return f"the compiled front speaks plain http:// to engines, not {https[0]}"
    return None


def front_options(
    config: GatewayConfig,
    engine_urls: Sequence[str],
    latency_buckets: Sequence[float],
    *,
    registered: bool = False,
) -> FrontOptions | None:
    """The compiled front's options, or None for the Python front; SystemExit when
    `--front compiled` was asked for a configuration it cannot serve."""
    front = config.front
    if front.front == "python":
        return None
    problem = front_unsupported(engine_urls, registered=registered)
    if problem is not None:
        if front.front == "compiled":
            raise SystemExit(f"--front compiled: {problem}; use --front python or auto")
        return None
    threads = front.front_threads if front.front_threads is not None else default_front_threads()
    if threads < 1:
        raise SystemExit("--front-threads must be at least 1")
    reliability = config.engines.reliability
    return FrontOptions(
        engine_urls=list(engine_urls),
        upstream_timeout=config.engines.timeout,
        threads=threads,
        latency_buckets=latency_buckets,
        engine_routing=config.engines.routing,
        reliability=reliability,
        health_path=reliability.health_check_endpoint,
    )


class CompiledFrontDoor:
    """Runs `_core.CompiledFront` on `listener`, answers its dispatched requests with the
    uvicorn server's app and adopts its hand-offs into that server, which accepts nothing
    itself (`serve_with_front`)."""

    def __init__(
        self, listener: socket.socket, frontend: FrontendSettings, options: FrontOptions
    ) -> None:
        self.server: QuietServer | None = None
        self.listener = listener
        self.frontend = frontend
        self.options = options
        self._front: Any = None
        self._wake_read = -1
        self._wake_write = -1
        self._adopting: set[asyncio.Task[Any]] = set()
        self._requests: DispatchedRequests | None = None
        # The engine set given at run time (`use_engines`), None while it is the start-up one.
        self.engines: list[str] | None = None
        # Engines that take no new request: while there are any, Python relays.
        self.held: list[str] = []

    @property
    def port(self) -> int:
        port: int = self.listener.getsockname()[1]
        return port

    def start(self, server: QuietServer) -> None:
        """Start serving; hand-offs go to `server` (call on the loop that serves it, once it
        has started)."""
        from sessiongate._core import CompiledFront

        self.server = server
        app = server.config.app
        if not isinstance(app, GatewayApp):
            raise TypeError(f"the compiled front serves a GatewayApp, not {type(app).__name__}")
        self._requests = DispatchedRequests(app)
        loop = asyncio.get_running_loop()
        self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._front = CompiledFront(
            self.listener.fileno(),
            self._wake_write,
            list(self.options.engine_urls),
            max_body_bytes=self.frontend.max_body_bytes,
            api_key=self.frontend.api_key,
            session_headers=list(self.frontend.session_headers),
            header_timeout=self.frontend.header_timeout,
            body_timeout=self.frontend.body_timeout,
            keepalive_timeout=KEEPALIVE_TIMEOUT_S,
            upstream_timeout=self.options.upstream_timeout,
            connect_timeout=min(CONNECT_TIMEOUT_S, self.options.upstream_timeout),
            threads=self.options.threads,
            latency_buckets=list(self.options.latency_buckets),
            dispatch=True,
            engine_policy=self.options.engine_routing.policy,
            engine_policy_options=self.options.engine_routing.options(),
            reliability=dataclasses.asdict(self.options.reliability),
        )
        self._apply_engines()
        loop.add_reader(self._wake_read, self._on_wake)

    def use_engines(self, urls: Sequence[str], held: Sequence[str] = ()) -> None:
        """Relay stateless requests to `urls` from now on: the engine set changed at run
        time (a registration or a removal). The front swaps its pool (kept engines keep
        their connections and health; requests in flight finish where they are). An empty
        set, or one with an engine the front cannot reach (not plain http://), is handed to
        Python instead, whose session core proxies (or refuses) through its own pool. So is
        every stateless request while any engine is `held` (paused): the Python pools hold
        requests for paused engines (engines/hold.py); the front has no queue."""
        self.engines = list(urls)
        self.held = list(held)
        self._apply_engines()

    def probed(self, url: str, error: str | None) -> None:
        """A health verdict of the process's prober (`EngineRegistry.feed`) on the engine the
        registry knows as `url`: the front probes nothing itself."""
        front = self._front
        if front is None:
            return
        for given in self.engines if self.engines is not None else self.options.engine_urls:
            if same_engine(given, url):
                front.probed(given.rstrip("/"), error)
                return

    def loads(self, url: str, report: LoadReport | None) -> None:
        """A `/v1/loads` poll's outcome (`EngineRegistry.feed_loads`) for the engine the
        registry knows as `url`: the front's policy takes it (the front polls nothing)."""
        front = self._front
        if front is None:
            return
        for given in self.engines if self.engines is not None else self.options.engine_urls:
            if same_engine(given, url):
                front.loads(given.rstrip("/"), report)
                return

    def _apply_engines(self) -> None:
        if self._front is None or self.engines is None:
            return  # start() applies it
        if self.engines and not self.held:
            try:
                self._front.set_engines(self.engines)
            except ValueError as exc:
                logger.warning("stateless requests go through Python: %s", exc)
            else:
                self._front.set_relay(True)
                return
        self._front.set_relay(False)

    def _on_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_read, 4096):
                pass
        front, requests = self._front, self._requests
        if front is None or requests is None:
            return
        requests.writable(front.take_writable())
        requests.serve(front.take_requests())
        for fd, data in front.take_handoffs():
            self._adopt(fd, data)

    def _adopt(self, fd: int, data: bytes) -> None:
        """Serve a handed-off connection with uvicorn, `data` first: the protocol gets the
        bytes inside `connection_made`, before the transport reads anything newer."""
        sock = socket.socket(fileno=fd)
        sock.setblocking(False)
        server = self.server
        if server is None or server.should_exit:
            sock.close()
            return
        config: uvicorn.Config = server.config
        # uvicorn types the class as type[asyncio.Protocol]; its HTTP protocols take these.
        protocol: asyncio.Protocol = config.http_protocol_class(  # type: ignore[call-arg]
            config=config,
            server_state=server.server_state,
            app_state=server.lifespan.state,
        )
        made = protocol.connection_made

        def connection_made(transport: asyncio.BaseTransport) -> None:
            made(transport)
            if data:
                protocol.data_received(data)

        # This one instance's method, wrapped to replay the bytes the door already read.
        protocol.connection_made = connection_made  # type: ignore[method-assign]
        loop = asyncio.get_running_loop()
        task = loop.create_task(loop.connect_accepted_socket(lambda: protocol, sock))
        self._adopting.add(task)
        task.add_done_callback(self._adopted)

    def _adopted(self, task: asyncio.Task[Any]) -> None:
        self._adopting.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("could not adopt a handed-off connection: %s", task.exception())

    def stats(self) -> dict[str, Any]:
        """The front's counters (`_core.CompiledFront.stats`); empty before start."""
        if self._front is None:
            return {}
        stats: dict[str, Any] = self._front.stats()
        return stats

    async def stop(self, grace: float = STOP_GRACE_S) -> None:
        """Stop accepting and let the front's requests finish (up to `grace`)."""
        front = self._front
        if front is not None:
            # The wake-ups are still served meanwhile: the dispatched requests in progress
            # finish on this loop (hand-offs are refused: uvicorn is exiting too).
            await asyncio.to_thread(front.stop, grace)
        self._front = None
        if self._wake_read >= 0:
            with contextlib.suppress(ValueError, OSError):
                asyncio.get_running_loop().remove_reader(self._wake_read)
        if self._requests is not None:
            await self._requests.drain(grace)
        for fd in (self._wake_read, self._wake_write):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._wake_read = self._wake_write = -1
        self.listener.close()


def open_front_door(
    config: GatewayConfig,
    frontend: FrontendSettings,
    engine_urls: Sequence[str],
    latency_buckets: Sequence[float],
    *,
    who: str,
    registered: bool = False,
) -> CompiledFrontDoor | None:
    """The front door `config` asks for, its public socket bound (`listen.host`,
    `listen.port`); None for the Python front. SystemExit naming `who` when the address
    cannot be bound. `registered`: the engines register at run time (`use_engines`)."""
    options = front_options(config, engine_urls, latency_buckets, registered=registered)
    if options is None:
        return None
    host, port = config.listen.host, config.listen.port
    try:
        listener = listening_socket(host, port, LISTEN_BACKLOG)
    except OSError as exc:
        raise SystemExit(f"{who}: cannot listen on {host}:{port}: {exc}") from None
    return CompiledFrontDoor(listener, frontend, options)


async def serve_with_front(
    server: QuietServer,
    door: CompiledFrontDoor | None,
    *,
    on_started: Callable[[int], None],
    default_port: int,
) -> int:
    """`serve_until_exit`, behind `door` when there is one: uvicorn then listens on nothing
    and serves the connections the door hands it. An exit request stops the door accepting
    at once, as uvicorn closes its listeners at once."""
    if door is None:
        return await serve_until_exit(server, on_started=on_started, default_port=default_port)
    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task[None]] = []

    def stop_door() -> None:
        if not stopping:
            stopping.append(loop.create_task(door.stop()))

    # From a signal handler, hence threadsafe.
    server.on_exit = lambda: loop.call_soon_threadsafe(stop_door)

    def started(_port: int) -> None:
        door.start(server)
        on_started(door.port)

    try:
        return await serve_until_exit(
            server, on_started=started, default_port=door.port, sockets=[]
        )
    finally:
        stop_door()
        await stopping[0]

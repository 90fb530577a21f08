"""The router's connector to one remote (TCP) worker: connect, handshake, attach the
channel, watch its heartbeat, and reconnect with backoff whenever it breaks.

While a worker is unreachable its slot stays in the router with the reason, so requests for
its shard answer 503 naming the worker and its endpoint; the other shards never wait for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sessiongate.config.workers import DEFAULT_HANDSHAKE_TIMEOUT
from sessiongate.dataplane.router.worker_channel import WorkerChannel
from sessiongate.dataplane.transport.connection import READ_SIZE, FrameConnection
from sessiongate.dataplane.transport.handshake import HandshakeError, client_handshake
from sessiongate.dataplane.transport.tcp import Endpoint, tune_socket

if TYPE_CHECKING:
    from sessiongate.dataplane.router.shard_router import ShardRouter

logger = logging.getLogger(__name__)

# How often the connector checks the heartbeat of a live channel.
_WATCH_INTERVAL_S = 0.5
# A connection that ends sooner than this counts as a failed attempt for the backoff.
_FLAPPING_S = 1.0


@dataclass(frozen=True)
class RemoteSettings:
    secret: bytes
    tls: ssl.SSLContext | None = None
    # Name checked against the worker's certificate instead of the endpoint's host.
    server_hostname: str | None = None
    connect_timeout: float = 5.0
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT
    # A worker beats every 0.5 s; this much silence means a partition or a hung worker.
    heartbeat_timeout: float = 10.0
    backoff_initial: float = 0.1
    backoff_max: float = 5.0


class RemoteWorker:
    """Keeps slot `index` of the router connected to the worker at `endpoint`."""

    def __init__(
        self, router: ShardRouter, index: int, endpoint: Endpoint, settings: RemoteSettings
    ) -> None:
        self.router = router
        self.index = index
        self.endpoint = endpoint
        self.settings = settings
        self.channel: WorkerChannel | None = None
        self.connections = 0
        self.connect_failures = 0
        self.restarts = 0  # times the worker process behind the slot changed (boot id)
        self.last_error: str | None = None
        self.boot_id: str | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # -- state shown by /health and /metrics ------------------------------------------

    @property
    def reconnects(self) -> int:
        """Connections established after the first one."""
        return max(0, self.connections - 1)

    @property
    def state(self) -> str:
        if self.channel is not None and self.channel.up:
            return "up"
        return "reconnecting" if self.connections else "connecting"

    @property
    def transport(self) -> str:
        return "tls" if self.settings.tls is not None else "tcp"

    def reason(self) -> str:
        """Why the slot is not up (for 503s and /health)."""
        if self.channel is not None and self.channel.down_reason and not self.last_error:
            return self.channel.down_reason
        return self.last_error or "connecting"

    def status(self) -> dict[str, Any]:
        return {
            "address": str(self.endpoint),
            "transport": self.transport,
            "reconnects": self.reconnects,
            "connect_failures": self.connect_failures,
        }

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"remote-worker-{self.index}")

    def set_endpoint(self, endpoint: Endpoint) -> None:
        """The worker moved (e.g. Ray restarted its actor elsewhere): drop the current
        connection and connect to the new address now, without waiting for the backoff."""
        if endpoint == self.endpoint:
            return
        logger.warning("worker %d moved from %s to %s", self.index, self.endpoint, endpoint)
        old = self.endpoint
        self.endpoint = endpoint
        if self.channel is not None and self.channel.down_reason is None:
            self.channel.close(f"the worker moved from {old} to {endpoint}")
        self._wake.set()

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        delay = self.settings.backoff_initial
        logged_error: str | None = None
        while True:
            # Cleared before reading the endpoint: a move from now on interrupts this attempt.
            self._wake.clear()
            endpoint = self.endpoint
            try:
                channel = await self._attempt(endpoint)
            except (HandshakeError, OSError, EOFError, TimeoutError) as exc:
                self.connect_failures += 1
                self.last_error = _describe(endpoint, exc)
                if self.last_error != logged_error:
                    logged_error = self.last_error
                    logger.warning("worker %d: %s (retrying)", self.index, self.last_error)
                if await self._sleep(delay):
                    delay = self.settings.backoff_initial
                else:
                    delay = min(delay * 2, self.settings.backoff_max)
                continue
            if channel is None or endpoint != self.endpoint:
                # The worker moved while we were dialling its old address.
                if channel is not None:
                    channel.close(f"the worker moved to {self.endpoint}")
                delay = self.settings.backoff_initial
                continue
            logged_error = None
            connected_at = time.monotonic()
            await self._watch(channel)
            self.last_error = f"connection to {endpoint} lost: {channel.down_reason}"
            if time.monotonic() - connected_at < _FLAPPING_S:
                # Dropped right after connecting (e.g. another router keeps taking the
                # worker over): back off instead of fighting in a tight loop.
                if not await self._sleep(delay):
                    delay = min(delay * 2, self.settings.backoff_max)
            else:
                delay = self.settings.backoff_initial

    async def _sleep(self, delay: float) -> bool:
        """Wait out the backoff; True when woken early by a new endpoint."""
        try:
            async with asyncio.timeout(delay):
                await self._wake.wait()
        except TimeoutError:
            return False
        finally:
            self._wake.clear()
        return True

    async def _attempt(self, endpoint: Endpoint) -> WorkerChannel | None:
        """One connection attempt; None when a new endpoint interrupted it (a dead node's
        address could otherwise hold the slot for the whole connect timeout)."""
        connecting = asyncio.create_task(self._connect(endpoint))
        woken = asyncio.create_task(self._wake.wait())
        try:
            await asyncio.wait({connecting, woken}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
            if not connecting.done():
                connecting.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await connecting
        if connecting.cancelled():
            return None
        return connecting.result()

    async def _connect(self, endpoint: Endpoint) -> WorkerChannel:
        settings = self.settings
        async with asyncio.timeout(settings.connect_timeout + settings.handshake_timeout):
            reader, writer = await asyncio.open_connection(
                endpoint.host,
                endpoint.port,
                ssl=settings.tls,
                server_hostname=(settings.server_hostname or endpoint.host)
                if settings.tls
                else None,
                ssl_handshake_timeout=settings.handshake_timeout if settings.tls else None,
                limit=READ_SIZE * 4,
            )
            try:
                sock = writer.get_extra_info("socket")
                if sock is not None:
                    tune_socket(sock)
                info = await client_handshake(
                    reader,
                    writer,
                    settings.secret,
                    {
                        "index": self.index,
                        "workers": self.router.worker_count,
                        "endpoint": str(endpoint),
                        "previous_boot": self.boot_id,
                    },
                )
            except BaseException:
                writer.close()
                raise
        boot_id = str(info.get("boot_id") or "")
        restarted = self.boot_id is not None and boot_id != self.boot_id
        if restarted:
            self.restarts += 1
        self.boot_id = boot_id
        self.connections += 1
        self.last_error = None
        # The first connection is routine; coming back after a loss is worth a warning.
        logger.log(
            logging.WARNING if self.connections > 1 else logging.INFO,
            "worker %d: connected to %s (pid %s%s)",
            self.index,
            endpoint,
            info.get("pid"),
            ", a new worker process" if restarted else "",
        )
        channel = WorkerChannel(
            self.index,
            FrameConnection.from_streams(reader, writer),
            generation=self.restarts,
            endpoint=str(endpoint),
        )
        self.channel = channel
        self.router.attach(channel, restarted=restarted)
        return channel

    async def _watch(self, channel: WorkerChannel) -> None:
        """Until the channel is down; closes it when the worker stops beating."""
        closed = asyncio.create_task(channel.wait_closed())
        since = time.monotonic()
        try:
            while True:
                done, _ = await asyncio.wait({closed}, timeout=_WATCH_INTERVAL_S)
                if done:
                    return
                last = channel.last_heartbeat or since
                silent = time.monotonic() - last
                if silent > self.settings.heartbeat_timeout:
                    channel.close(f"no heartbeat for {silent:.1f} s")
        finally:
            closed.cancel()


def _describe(endpoint: Endpoint, exc: BaseException) -> str:
    if isinstance(exc, HandshakeError):
        return f"handshake with {endpoint} failed: {exc}"
    if isinstance(exc, TimeoutError):
        return f"no answer from {endpoint} (connect or handshake timed out)"
    if isinstance(exc, ssl.SSLError):
        return f"TLS with {endpoint} failed: {exc} (does the worker have --tls-cert?)"
    if isinstance(exc, EOFError):  # IncompleteReadError: the worker hung up mid-handshake
        return (
            f"{endpoint} closed the connection during the handshake (a TLS worker needs "
            "--tls-ca or --tls-insecure on the router)"
        )
    if isinstance(exc, ConnectionRefusedError):
        return f"connection to {endpoint} refused (is the worker running?)"
    return f"cannot connect to {endpoint}: {exc}"

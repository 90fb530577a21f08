"""`sessiongate worker`: one session worker listening on TCP, for any orchestrator
(Kubernetes, Slurm, Ray, by hand); `sessiongate serve --worker-endpoints` routes to it.

It owns one session core and serves one router connection at a time: a newer connection
that passes the handshake replaces the current one (a router that restarted, or reconnected
after a network blip, must never be locked out by a half-dead old connection). Sessions live
in the worker, so they survive router reconnects. Anything else that connects (a wrong
secret, another protocol version, an HTTP client, a port scanner) is told why it is refused
and closed; the worker keeps serving.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import signal
import socket
import ssl
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sessiongate.config.cli import add_options, config_from_args
from sessiongate.config.gateway import GatewayConfig
from sessiongate.config.workers import DEFAULT_HANDSHAKE_TIMEOUT
from sessiongate.dataplane.transport.tcp import Endpoint
from sessiongate.process.children import PARENT_PID_ENV, die_with_parent
from sessiongate.process.memory import keep_freed_records_warm
from sessiongate.session.core_config import STANDALONE, CoreConfig, core_config
from sessiongate.session.core_options import engine_urls

if TYPE_CHECKING:
    from sessiongate.dataplane.transport.connection import FrameConnection
    from sessiongate.session.core import SessionCore

logger = logging.getLogger(__name__)

_TLS_RECORD_HANDSHAKE = b"\x16"  # the first byte of every TLS ClientHello
_PARENT_POLL_S = 0.5
# How long a refused connection may take to hang up after our answer.
_LINGER_S = 1.0
READ_CHUNK = 65536
TLS_REQUIRED = "this worker requires TLS: start the router with --tls-ca FILE (or --tls-insecure)"


WORKER = "worker"


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        WORKER,
        help="run one session worker on a TCP port (for serve --worker-endpoints)",
        description="Run one session worker that a router (`sessiongate serve "
        "--worker-endpoints`) reaches over authenticated TCP. It prints 'sessiongate worker "
        "listening on HOST:PORT' once ready.",
    )
    add_options(parser, WORKER)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args, WORKER)
    if args.print_config:
        from sessiongate.config.files import render_toml

        print(render_toml(config, WORKER), end="")
        return 0
    return serve_tcp_worker(config)


def serve_tcp_worker(config: GatewayConfig) -> int:
    """One session worker listening at `config.workers.listen` until signalled (or its
    parent, a Ray actor, is gone)."""
    from sessiongate.dataplane.transport.tcp import load_secret, parse_endpoint, server_tls_context

    if not die_with_parent():
        return 0
    logging.basicConfig(
        level=config.log_level.upper(), format="sessiongate worker: %(levelname)s %(message)s"
    )
    keep_freed_records_warm()
    workers = config.workers

    def fail(message: str) -> SystemExit:
        return SystemExit(f"sessiongate worker: {message}")

    if workers.listen is None:
        raise fail("--listen is required")
    try:
        endpoint = parse_endpoint(workers.listen, allow_port_zero=True)
        secret = load_secret(workers.secret_file, workers.secret_env)
    except ValueError as exc:
        raise fail(str(exc)) from None
    if bool(workers.tls_cert) != bool(workers.tls_key):
        raise fail("--tls-cert and --tls-key go together")
    try:
        tls = (
            server_tls_context(workers.tls_cert, workers.tls_key)
            if workers.tls_cert and workers.tls_key
            else None
        )
    except (OSError, ssl.SSLError) as exc:
        raise fail(f"cannot load the TLS certificate or key: {exc}") from None
    try:
        engine_urls(config.engines, embedded_mock=False)
    except SystemExit as exc:
        raise fail(str(exc)) from None
    if workers.handshake_timeout <= 0:
        raise fail("--handshake-timeout must be > 0")
    # Exits with a clear message on bad session options.
    core = core_config(config, STANDALONE, program="sessiongate worker")
    try:
        return asyncio.run(_main(core, endpoint, secret, tls, workers.handshake_timeout))
    except KeyboardInterrupt:
        return 0


async def _main(
    config: CoreConfig,
    endpoint: Endpoint,
    secret: bytes,
    tls: ssl.SSLContext | None,
    handshake_timeout: float,
) -> int:
    from sessiongate.dataplane.transport.tcp import listen_socket
    from sessiongate.session.factory import build_core

    try:
        listener = listen_socket(endpoint)
    except OSError as exc:
        print(f"sessiongate worker: cannot listen on {endpoint}: {exc}", file=sys.stderr)
        return 1
    core = build_core(config)
    core.start()  # probe the upstreams before the first request (their state is in /health)
    server = WorkerServer(core, secret, tls, handshake_timeout)
    host, port = listener.getsockname()[:2]
    bound = Endpoint(host, port)
    print(
        f"sessiongate worker listening on {bound} ({'TLS' if tls else 'plaintext'}, "
        f"pid {os.getpid()})",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    accepting = asyncio.create_task(server.accept_forever(listener))
    watcher = asyncio.create_task(_watch_parent(stop))
    try:
        await stop.wait()
    finally:
        accepting.cancel()
        watcher.cancel()
        listener.close()
        await server.aclose()
        await core.aclose()
    print(f"sessiongate worker on {bound} stopped", file=sys.stderr, flush=True)
    return 0


async def _watch_parent(stop: asyncio.Event) -> None:
    """Belt and braces next to PDEATHSIG when a parent (a Ray actor) started us."""
    raw = os.environ.get(PARENT_PID_ENV)
    if not raw or not raw.isdigit():
        return
    while os.getppid() == int(raw):
        await asyncio.sleep(_PARENT_POLL_S)
    stop.set()


@dataclass
class _RouterConnection:
    conn: FrameConnection
    task: asyncio.Task[str]
    peer: str


class WorkerServer:
    def __init__(
        self,
        core: SessionCore,
        secret: bytes,
        tls: ssl.SSLContext | None,
        handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    ) -> None:
        self.core = core
        self.secret = secret
        self.tls = tls
        self.handshake_timeout = handshake_timeout
        # Tells a router whether it is talking to the process it knew: a new boot id means
        # the sessions it held are gone.
        self.boot_id = secrets.token_hex(8)
        self.started_at = time.time()
        self.current: _RouterConnection | None = None
        self._restart_noted = False
        self._tasks: set[asyncio.Task[Any]] = set()

    def info(self) -> dict[str, Any]:
        from sessiongate import __version__

        return {
            "pid": os.getpid(),
            "boot_id": self.boot_id,
            "started_at": self.started_at,
            "sessiongate": __version__,
            "tls": self.tls is not None,
        }

    async def accept_forever(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, address = await loop.sock_accept(listener)
            except OSError as exc:  # e.g. EMFILE: keep the worker alive, retry shortly
                logger.error("accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            task = asyncio.create_task(self._handle(sock, _peer(address)))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _handle(self, sock: socket.socket, peer: str) -> None:
        from sessiongate.dataplane.transport.handshake import (
            HandshakeError,
            encode_error,
            refuse,
            server_handshake,
        )
        from sessiongate.dataplane.transport.tcp import tune_socket

        streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            tune_socket(sock)
            async with asyncio.timeout(self.handshake_timeout):
                first = await _peek(sock)
                if not first:  # connected and closed without a byte: a port probe
                    sock.close()
                    return
                wants_tls = first == _TLS_RECORD_HANDSHAKE
                if wants_tls and self.tls is None:
                    # It cannot read a plaintext answer; its TLS error is all it will see.
                    raise HandshakeError("a TLS client on a plaintext worker (no --tls-cert)")
                streams = await self._open(sock, wants_tls)
                router = await server_handshake(
                    *streams,
                    self.secret,
                    self.info(),
                    refuse_reason=TLS_REQUIRED if self.tls and not wants_tls else None,
                )
        except TimeoutError:
            logger.warning("refused %s: handshake timed out", peer)
            reason = f"handshake timed out after {self.handshake_timeout:g} s"
            if streams is not None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        await refuse(streams[1], reason)
            else:  # silent client: nothing read yet, answer on the raw socket
                with contextlib.suppress(OSError):
                    sock.send(encode_error(reason))
        except HandshakeError as exc:
            logger.warning("refused %s: %s", peer, exc)
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            # Port probes and TLS failures land here: not worth a warning.
            logger.info("connection from %s closed during the handshake: %r", peer, exc)
        else:
            assert streams is not None
            self._adopt(*streams, router, peer)
            return
        if streams is not None:
            await _linger(*streams)
        else:
            await _linger_socket(sock)

    async def _open(
        self, sock: socket.socket, tls: bool
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Streams over an accepted socket, server-side TLS when the client asked for it."""
        from sessiongate.dataplane.transport.connection import READ_SIZE

        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=READ_SIZE * 4)
        protocol = asyncio.StreamReaderProtocol(reader)
        transport, _ = await loop.connect_accepted_socket(
            lambda: protocol,
            sock,
            ssl=self.tls if tls else None,
            ssl_handshake_timeout=self.handshake_timeout if tls else None,
        )
        return reader, asyncio.StreamWriter(transport, protocol, reader, loop)

    def _adopt(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        router: dict[str, Any],
        peer: str,
    ) -> None:
        from sessiongate.dataplane.transport.connection import FrameConnection
        from sessiongate.dataplane.worker.loop import WorkerLoop
        from sessiongate.dataplane.worker.status import core_status, restart_note

        index = int(router.get("index") or 0)
        previous = router.get("previous_boot")
        if previous and previous != self.boot_id and not self._restart_noted:
            # The router knew another process in this slot: its sessions died with it.
            self._restart_noted = True
            note = restart_note(index)
            with contextlib.suppress(AttributeError, TypeError):
                self.core.settings = dataclasses.replace(self.core.settings, not_found_note=note)
        conn = FrameConnection.from_streams(reader, writer)
        loop = WorkerLoop(
            conn,
            self.core.handle,
            index=index,
            generation=int(router.get("generation") or 0),
            status=lambda: core_status(self.core),
        )
        old = self.current
        task = asyncio.create_task(loop.run())
        current = _RouterConnection(conn, task, peer)
        self.current = current
        if old is not None:
            logger.warning("router connection from %s replaces the one from %s", peer, old.peer)
            old.conn.close()
        else:
            logger.info("router connected from %s (worker %d)", peer, index)

        def ended(done: asyncio.Task[str]) -> None:
            if self.current is current:
                self.current = None
            if not done.cancelled():
                logger.info("router connection from %s ended: %s", peer, done.result())

        task.add_done_callback(ended)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        current = self.current
        if current is not None:
            current.conn.close()
            with contextlib.suppress(asyncio.CancelledError):
                await current.task


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Close a refused connection without resetting it: closing with unread input would
    send an RST, and the peer could lose the refusal we just wrote."""
    with contextlib.suppress(Exception):
        if writer.can_write_eof():
            writer.write_eof()
        async with asyncio.timeout(_LINGER_S):
            while await reader.read(READ_CHUNK):
                pass
    writer.close()


async def _linger_socket(sock: socket.socket) -> None:
    """`_linger` for a socket without streams."""
    loop = asyncio.get_running_loop()
    with contextlib.suppress(Exception):
        sock.shutdown(socket.SHUT_WR)
        async with asyncio.timeout(_LINGER_S):
            while await loop.sock_recv(sock, READ_CHUNK):
                pass
    sock.close()


async def _peek(sock: socket.socket) -> bytes:
    """The first byte the client sent, left in the socket; b"" when it closed first."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            return sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            pass
        readable: asyncio.Future[None] = loop.create_future()
        loop.add_reader(sock.fileno(), _resolve, readable)
        try:
            await readable
        finally:
            loop.remove_reader(sock.fileno())


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _peer(address: Any) -> str:
    if isinstance(address, tuple) and len(address) >= 2:
        return str(Endpoint(str(address[0]), int(address[1])))
    return str(address)

"""Remote session workers over authenticated TCP, with real processes on loopback: the
equivalence script across transports, handshake refusals (wrong secret, wrong version, plain
HTTP, garbage, silence) that never crash the worker, a killed worker's shard answering 503
naming it while the other shard serves, reconnection, TLS, and the in-process handshake."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sessiongate.dataplane.transport import handshake
from sessiongate.dataplane.transport.frames import FRAME_HEARTBEAT
from sessiongate.dataplane.transport.handshake import (
    HandshakeError,
    client_handshake,
    server_handshake,
)
from sessiongate.dataplane.transport.tcp import Endpoint, parse_endpoint, parse_endpoints
from sessiongate.primitives import FrameDecoder
from support.dataplane import _equivalence_script
from support.procs import ServerProcess, free_port
from support.tcp_workers import (
    SECRET,
    WorkerProcess,
    chat,
    eventually,
    health,
    router,
    sessions_on_each_shard,
)

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs


@pytest.fixture()
def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    return path


MODULES_ENV = "SESSIONGATE_ROUTER_MODULES_REPORT"


@pytest.fixture()
def engine() -> Iterator[ServerProcess]:
    port = free_port()
    with ServerProcess(["mock-engine", "--port", str(port)], port) as proc:
        yield proc


# -- equivalence ---------------------------------------------------------------------------


def test_two_tcp_workers_answer_like_one_local_worker(
    engine: ServerProcess, secret_file: Path, tmp_path: Path
) -> None:
    report = tmp_path / "modules.json"
    port = free_port()
    with ServerProcess(["serve", "--port", str(port), "--workers", "1"], port) as local:
        expected, _ = _equivalence_script(local.url)
    with (
        WorkerProcess(free_port(), secret_file, engine.url) as w0,
        WorkerProcess(free_port(), secret_file, engine.url) as w1,
        router(secret_file, w0.endpoint, w1.endpoint, env={MODULES_ENV: str(report)}) as gateway,
    ):
        eventually(lambda: health(gateway.url)[0] == 200, "both workers up")
        steps, owners = _equivalence_script(gateway.url, cover=2)
        states = health(gateway.url)[1]["workers"]
    # The router stays thin with remote workers too: no session core, no tokenizer, no Ray.
    modules = set(json.loads(report.read_text()))
    assert "sessiongate.dataplane.placement.remote" in modules
    forbidden = {"sessiongate.session.core", "sessiongate.tokenizer", "tokenizers", "ray"}
    assert not modules & forbidden, modules & forbidden
    assert owners == {0, 1}, "sessions should land on both TCP workers"
    assert [(s["address"], s["transport"], s["state"]) for s in states] == [
        (w0.endpoint, "tcp", "up"),
        (w1.endpoint, "tcp", "up"),
    ]
    assert len(steps) == len(expected)
    for left, right in zip(expected, steps, strict=True):
        assert left == right


# -- refusals ------------------------------------------------------------------------------


async def _attempt(port: int, secret: bytes, *, version: int = 1) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        await client_handshake(reader, writer, secret, {"index": 0}, version=version)
        return "accepted"
    except HandshakeError as exc:
        return str(exc)
    finally:
        writer.close()


async def _raw(port: int, data: bytes) -> bytes:
    """Send `data` (maybe nothing), return everything the worker answers until it closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    try:
        return await asyncio.wait_for(reader.read(), timeout=30)
    finally:
        writer.close()


def test_worker_refuses_strangers_clearly_and_keeps_serving(
    engine: ServerProcess, secret_file: Path
) -> None:
    port = free_port()
    with WorkerProcess(port, secret_file, engine.url, "--handshake-timeout", "1") as worker:
        wrong = asyncio.run(_attempt(port, b"not-the-secret-at-all-0123456789"))
        assert "authentication failed: wrong shared secret" in wrong
        version = asyncio.run(_attempt(port, SECRET.encode(), version=2))
        assert "protocol version mismatch" in version and "v1" in version and "v2" in version

        answer = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
        assert answer.status_code == 400
        assert "sessiongate worker port" in answer.text

        garbage = asyncio.run(_raw(port, b"\x00\x01garbage that is no handshake\r\n"))
        assert b"not a sessiongate router" in garbage
        silent = asyncio.run(_raw(port, b""))
        assert b"handshake timed out" in silent
        tls_hello = asyncio.run(_raw(port, b"\x16\x03\x01\x00\x05hello"))
        assert tls_hello == b""  # a TLS client cannot read a plaintext answer: closed

        # A router with the wrong secret is refused too, and says why and where.
        wrong_file = secret_file.with_name("wrong")
        wrong_file.write_text("another-secret-0123456789abcdef")
        wrong_file.chmod(0o600)
        with router(wrong_file, worker.endpoint) as gateway:
            status, body = eventually(
                lambda: (lambda h: h if "authentication failed" in str(h[1]) else None)(
                    health(gateway.url)
                ),
                "the router reports the refused handshake",
            )
            assert status == 503
            assert worker.endpoint in body["error"] and "wrong shared secret" in body["error"]
            refused = httpx.post(gateway.url + "/sessions")
            assert refused.status_code == 503 and worker.endpoint in refused.json()["error"]

        assert worker.proc is not None and worker.proc.poll() is None, worker.output()
        assert asyncio.run(_attempt(port, SECRET.encode())) == "accepted"
        log = worker.output()
        for reason in ("wrong shared secret", "version mismatch", "plain HTTP", "timed out"):
            assert reason in log, log


def test_a_newer_router_connection_replaces_the_old_one(
    engine: ServerProcess, secret_file: Path
) -> None:
    async def scenario(port: int) -> None:
        first_reader, first_writer = await asyncio.open_connection("127.0.0.1", port)
        await client_handshake(first_reader, first_writer, SECRET.encode(), {"index": 0})
        decoder = FrameDecoder()
        frames: list[tuple[int, int, bytes]] = []
        while not frames:  # a frame may arrive in several segments
            data = await asyncio.wait_for(first_reader.read(65536), timeout=30)
            assert data, "the worker closed the channel"
            frames = decoder.feed(data)
        assert frames[0][0] == FRAME_HEARTBEAT  # the channel is live
        second_reader, second_writer = await asyncio.open_connection("127.0.0.1", port)
        await client_handshake(second_reader, second_writer, SECRET.encode(), {"index": 0})
        # The old connection is closed by the worker (EOF after any frames in flight).
        while await asyncio.wait_for(first_reader.read(65536), timeout=30):
            pass
        assert await second_reader.read(65536)  # the new one gets heartbeats
        first_writer.close()
        second_writer.close()

    port = free_port()
    with WorkerProcess(port, secret_file, engine.url):
        asyncio.run(scenario(port))


# -- worker loss ---------------------------------------------------------------------------


def test_killed_worker_gives_503_for_its_shard_only_until_it_is_back(
    engine: ServerProcess, secret_file: Path
) -> None:
    ports = [free_port(), free_port()]
    w0 = WorkerProcess(ports[0], secret_file, engine.url).start()
    w1 = WorkerProcess(ports[1], secret_file, engine.url).start()
    try:
        with router(secret_file, w0.endpoint, w1.endpoint) as gateway:
            url = gateway.url
            eventually(lambda: health(url)[0] == 200, "both workers up")
            kept, lost = sessions_on_each_shard(url)
            assert chat(url, lost).status_code == 200

            assert w1.proc is not None
            os.kill(w1.proc.pid, signal.SIGKILL)
            w1.proc.wait()
            down = eventually(
                lambda: (lambda r: r if r.status_code == 503 else None)(chat(url, lost)),
                "the dead worker's shard answers 503",
            )
            assert w1.endpoint in down.json()["error"], down.text
            assert chat(url, kept, "still").status_code == 200
            status, body = health(url)
            assert status == 503 and w1.endpoint in body["error"]
            dead = body["workers"][1]
            assert dead["state"] == "reconnecting" and dead["address"] == w1.endpoint

            w1.stop()
            w1 = WorkerProcess(ports[1], secret_file, engine.url).start()
            eventually(lambda: health(url)[0] == 200, "the restarted worker is back")
            gone = httpx.get(f"{url}/sessions/{lost}")
            assert gone.status_code == 404 and "restarted" in gone.json()["error"]
            fresh = sessions_on_each_shard(url)[1]
            assert chat(url, fresh, "new").status_code == 200
            assert httpx.get(f"{url}/sessions/{kept}").json()["records"]  # kept its history
            back = health(url)[1]["workers"][1]
            assert back["reconnects"] == 1 and back["generation"] == 1
            assert back["connect_failures"] >= 1
            metrics = httpx.get(url + "/metrics").text
            assert (
                f'sessiongate_worker_reconnects_total{{worker="1",address="{w1.endpoint}"}} 1'
                in (metrics)
            )
            assert f'worker="0",address="{w0.endpoint}",transport="tcp",state="up"' in metrics
    finally:
        w0.stop()
        w1.stop()


# -- TLS -----------------------------------------------------------------------------------


@pytest.fixture()
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-keyout", str(key), "-out", str(cert), "-subj", "/CN=sessiongate-test",
            "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


def test_tls_worker_needs_a_tls_router(
    engine: ServerProcess, secret_file: Path, certificate: tuple[Path, Path]
) -> None:
    cert, key = certificate
    tls = ("--tls-cert", str(cert), "--tls-key", str(key))
    with WorkerProcess(free_port(), secret_file, engine.url, *tls) as worker:
        with router(secret_file, worker.endpoint) as plain:
            status, _ = eventually(
                lambda: (lambda h: h if "requires TLS" in str(h[1]) else None)(health(plain.url)),
                "a plaintext router is told the worker requires TLS",
            )
            assert status == 503
        for options in (("--tls-ca", str(cert)), ("--tls-insecure",)):
            with router(secret_file, worker.endpoint, extra=options) as gateway:
                eventually(lambda: health(gateway.url)[0] == 200, "TLS channel up")
                sid = httpx.post(gateway.url + "/sessions").json()["session_id"]
                assert chat(gateway.url, sid).status_code == 200
                assert health(gateway.url)[1]["workers"][0]["transport"] == "tls"
        answer = httpx.get(f"http://127.0.0.1:{worker.port}/", timeout=10)
        assert answer.status_code == 400 and "sessiongate worker port" in answer.text
        assert worker.proc is not None and worker.proc.poll() is None


# -- command line --------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sessiongate", *args], capture_output=True, text=True, timeout=60
    )


def test_bad_remote_options_fail_clearly(tmp_path: Path, secret_file: Path) -> None:
    short = tmp_path / "short"
    short.write_text("tiny")
    secret = ["--secret-file", str(secret_file)]
    backend = ["--backend", "http://x:1"]
    cases = [
        (["serve", "--worker-endpoints", "127.0.0.1:1"], "a shared secret is required"),
        (
            ["serve", "--worker-endpoints", "127.0.0.1:1", "--secret-file", str(short)],
            "use at least 16",
        ),
        (["serve", "--worker-endpoints", "nohost", *secret], "is not HOST:PORT"),
        (["serve", "--worker-endpoints", "a:1,a:1", *secret], "must be distinct"),
        (["serve", "--worker-endpoints", "a:1", *secret, "--ray"], "exclude each other"),
        (["serve", "--worker-endpoints", "a:1", *secret, *backend], "give --backend to each"),
        (["serve", *secret], "applies to --worker-endpoints only"),
        (
            ["worker", "--listen", "127.0.0.1:0", "--secret-file", str(short), *backend],
            "use at least 16",
        ),
        (
            ["worker", "--listen", "127.0.0.1:0", *secret, *backend, "--tls-cert", "c.pem"],
            "--tls-cert and --tls-key go together",
        ),
    ]
    for args, message in cases:
        result = _cli(*args)
        assert result.returncode != 0 and message in result.stderr, (args, result.stderr)


# -- the handshake in-process ----------------------------------------------------------------


async def _serve_once(
    secret: bytes, handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Any]
) -> tuple[asyncio.Server, int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_handshake_authenticates_both_sides() -> None:
    secret = b"0123456789abcdef0123"

    async def scenario() -> None:
        seen: list[Any] = []

        async def worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                seen.append(await server_handshake(reader, writer, secret, {"pid": 7}))
            except HandshakeError as exc:
                seen.append(exc)
            writer.close()

        server, port = await _serve_once(secret, worker)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        info = await client_handshake(reader, writer, secret, {"index": 3})
        writer.close()
        assert info == {"pid": 7}
        await asyncio.sleep(0.05)
        assert seen == [{"index": 3}]

        # An impostor worker that cannot prove the secret is refused by the router.
        async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readexactly(handshake.HEADER_SIZE)
            await reader.read(handshake.MAX_PAYLOAD)
            writer.write(handshake.encode_message(handshake.KIND_CHALLENGE, os.urandom(32)))
            await reader.readexactly(handshake.HEADER_SIZE + handshake.MAC_SIZE)
            fake = os.urandom(handshake.MAC_SIZE) + b'{"pid": 1}'
            writer.write(handshake.encode_message(handshake.KIND_ACCEPT, fake))
            await writer.drain()
            seen.append(await reader.read())  # the router's reason
            writer.close()

        fake_server, fake_port = await _serve_once(secret, impostor)
        reader, writer = await asyncio.open_connection("127.0.0.1", fake_port)
        with pytest.raises(HandshakeError, match="worker's proof does not match"):
            await client_handshake(reader, writer, secret, {"index": 0})
        writer.close()
        await asyncio.sleep(0.05)
        assert b"authentication failed" in seen[-1]
        for srv in (server, fake_server):
            srv.close()
            await srv.wait_closed()

    asyncio.run(scenario())


def test_endpoints_parse_and_print() -> None:
    assert parse_endpoint("host-a:7000") == Endpoint("host-a", 7000)
    assert str(parse_endpoint("[::1]:7000")) == "[::1]:7000"
    assert parse_endpoint("0.0.0.0:0", allow_port_zero=True).port == 0
    assert parse_endpoints("a:1, b:2,") == [Endpoint("a", 1), Endpoint("b", 2)]
    for bad, reason in (
        ("a", "is not HOST:PORT"),
        (":7000", "is not HOST:PORT"),
        ("::1:7000", "in brackets"),
        ("a:0", "from 1 to 65535"),
        ("a:70000", "from 1 to 65535"),
        ("a:x", "from 1 to 65535"),
    ):
        with pytest.raises(ValueError, match=reason):
            parse_endpoint(bad)


def test_router_follows_a_worker_that_moved_in_process() -> None:
    """The connector's state machine without processes: a dead address is retried, a new
    endpoint (what Ray placement sends) is dialled at once, requests then reach the worker,
    and a restarted worker (new boot id) counts as a restart."""
    from types import SimpleNamespace

    from sessiongate.dataplane.placement.remote import RemoteSettings, RemoteWorker
    from sessiongate.dataplane.router.shard_router import ShardRouter
    from sessiongate.dataplane.transport.tcp import listen_socket
    from sessiongate.dataplane.worker.server import WorkerServer
    from sessiongate.protocol import CoreReply, CoreRequest

    secret = SECRET.encode()

    async def echo(request: CoreRequest) -> CoreReply:
        return CoreReply(200, [("x-op", request.op)], request.body)

    def fake_core() -> Any:
        upstream = SimpleNamespace(
            affinity_hits=0, repins=0, all_down=False, upstream_states=list, engine_counts=list
        )
        return SimpleNamespace(
            handle=echo,
            sessions={},
            turns_recorded=0,
            turns_aborted=0,
            rollbacks=0,
            rollback_steps=0,
            r3_missing_turns=0,
            relay_buffered_turns=0,
            upstream=upstream,
            stamper=None,
            limits_status=dict,
        )

    async def until(condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 30
        while not condition():
            assert time.monotonic() < deadline, f"never happened: {what}"
            await asyncio.sleep(0.02)

    async def scenario() -> None:
        listener = listen_socket(Endpoint("127.0.0.1", 0))
        address = Endpoint("127.0.0.1", listener.getsockname()[1])
        server = WorkerServer(fake_core(), secret, None)
        accepting = asyncio.create_task(server.accept_forever(listener))
        dead = Endpoint("127.0.0.1", free_port())
        router = ShardRouter(
            1,
            remotes=lambda router, index: RemoteWorker(router, index, dead, RemoteSettings(secret)),
        )
        assert router.remotes is not None
        remote = router.remotes[0]
        assert isinstance(remote, RemoteWorker)
        router.start()
        await until(lambda: remote.connect_failures >= 2, "the dead address is retried")
        assert remote.state == "connecting" and "refused" in router.down_reason(0)
        down = await router.handle(CoreRequest(op="get", session_id="a" * 32))
        assert down.status == 503 and b"refused" in down.body

        router.set_endpoint(0, str(address))
        await until(lambda: remote.state == "up", "connected to the new address")
        reply = await router.handle(CoreRequest(op="get", session_id="a" * 32, body=b"hi"))
        assert (reply.status, reply.body) == (200, b"hi")
        assert router.worker_states()[0]["address"] == str(address)

        # A new worker process behind the same address: a reconnect and a restart.
        assert server.current is not None
        server.current.conn.close()
        server.boot_id = "another-process"
        await until(lambda: remote.connections == 2 and remote.state == "up", "reconnected")
        assert (remote.reconnects, remote.restarts, router.worker_restarts) == (1, 1, 1)

        await router.aclose()
        accepting.cancel()
        await server.aclose()
        listener.close()

    asyncio.run(scenario())

"""Bulk reply bodies a local worker writes on the client's connection, lent by the front
(dataplane/transport/lent_replies.py): the same bytes as files and frames, refusals and
silence fall back to files, a client gone fails the request, a cancel closes the worker's
descriptor, and end to end the compiled front lends while the other paths do not.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessiongate.dataplane.router.worker_channel import WorkerFailed
from sessiongate.dataplane.transport import lent_replies
from sessiongate.dataplane.transport.lent_replies import chunked, open_offer
from sessiongate.protocol import FilePart, LendOffer
from support.procs import ServerProcess, free_port, mock_engine
from support.worker_pair import bulk_reply, close_pair, get_meta, open_pair

PARTS = [bytes([n]) * size for n, size in enumerate((9 << 20, 5, 700_000, 1 << 20))]
BODY = b"".join(PARTS)


def _dechunk(data: bytes, sizes: list[int] | None = None) -> bytes:
    body, rest = bytearray(), data
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            assert rest == b"\r\n"
            return bytes(body)
        assert len(rest) >= size + 2 and rest[size : size + 2] == b"\r\n"
        if sizes is not None:
            sizes.append(size)
        body += rest[:size]
        rest = rest[size + 2 :]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=300), max_size=10),
    st.integers(min_value=1, max_value=64),
)
def test_chunks_frame_the_segment_from_its_own_memory(sizes: list[int], chunk: int) -> None:
    parts = [bytes([n % 251]) * size for n, size in enumerate(sizes)]
    views = chunked([memoryview(p) for p in parts], chunk)
    sent: list[int] = []
    assert _dechunk(b"".join(bytes(v) for v in views) + b"0\r\n\r\n", sent) == b"".join(parts)
    assert all(0 < n <= chunk for n in sent) and all(n == chunk for n in sent[:-1])
    framing = [v for v in views if not any(v.obj is p for p in parts)]
    assert len(framing) == 2 * len(sent)  # a size line and a CRLF per chunk; the rest are views


@pytest.mark.parametrize(
    ("directory", "payload", "message"),
    [
        (None, b'{"socket":"a.lend"}', "not this router's child"),
        ("/tmp/x", b"not json", "bad BODY_LEND frame"),
        ("/tmp/x", b'{"file":"a"}', "bad BODY_LEND frame"),
        ("/tmp/x", b'{"socket":"../a"}', "bad lent reply socket name"),
        ("/tmp/x", b'{"socket":""}', "bad lent reply socket name"),
        ("/tmp/x", b'{"socket":7}', "bad lent reply socket name"),
    ],
)
def test_offer_frames_are_checked(directory: str | None, payload: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        open_offer(directory, payload)
    assert open_offer("/tmp/x", b'{"socket":"a.lend"}').path == "/tmp/x/a.lend"


async def _lend(offer: LendOffer, client: socket.socket) -> None:
    """What the compiled front does (rust/front/lend.rs): the socket and its one byte."""
    peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    peer.setblocking(False)
    await asyncio.get_running_loop().sock_connect(peer, offer.path)
    socket.send_fds(peer, [lent_replies.LEND_CHUNKED], [client.fileno()])
    peer.close()


async def _read_all(sock: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    out = bytearray()
    while chunk := await loop.sock_recv(sock, 1 << 20):
        out += chunk
    return bytes(out)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_lent_reply_is_the_body_in_chunks_and_leaves_nothing(tmp_path: Path) -> None:
    async def run() -> None:
        channel, worker, serving, sock = await open_pair(
            bulk_reply(PARTS), str(tmp_path), str(tmp_path), lend_replies=True
        )
        client, reader = socket.socketpair()
        client.setblocking(False)  # as the front's runtime keeps it
        reader.setblocking(False)
        try:
            fds = _open_fds()
            got = await channel.request(get_meta(), b"")
            assert got.stream is not None
            reading = asyncio.create_task(_read_all(reader))
            kinds = []
            async for part in got.stream:
                kinds.append(type(part).__name__)
                assert isinstance(part, LendOffer)
                await _lend(part, client)
            # The worker is done and closed its descriptor: the front ends the reply.
            assert _open_fds() == fds
            client.sendall(b"0\r\n\r\n")
            client.close()
            assert _dechunk(await reading) == BODY
            assert kinds == ["LendOffer"] and worker.replies_lent == 1
            assert not list(tmp_path.iterdir())  # the offer's socket is gone
        finally:
            await close_pair(channel, serving, sock)

    asyncio.run(run())


@pytest.mark.parametrize("answer", ["refused", "silent"])
def test_a_refused_or_unanswered_offer_sends_files(
    tmp_path: Path, answer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lent_replies, "ANSWER_TIMEOUT", 0.2)

    async def run() -> None:
        channel, worker, serving, sock = await open_pair(
            bulk_reply(PARTS), str(tmp_path), str(tmp_path), lend_replies=True
        )
        try:
            got = await channel.request(get_meta(), b"")
            assert got.stream is not None
            out, kinds = bytearray(), []
            async for part in got.stream:
                kinds.append(type(part).__name__)
                if isinstance(part, LendOffer):
                    if answer == "refused":
                        await part.decline()
                elif isinstance(part, FilePart):
                    out += b"".join([chunk async for chunk in part])
                else:
                    out += part
            assert bytes(out) == BODY
            assert kinds[0] == "LendOffer" and set(kinds[1:]) == {"FilePart"}
            assert worker.replies_lent == 0
            assert not list(tmp_path.iterdir())
        finally:
            await close_pair(channel, serving, sock)

    asyncio.run(run())


def test_a_client_gone_fails_the_request_and_closes_the_descriptor(tmp_path: Path) -> None:
    async def run() -> None:
        channel, worker, serving, sock = await open_pair(
            bulk_reply(PARTS), str(tmp_path), str(tmp_path), lend_replies=True
        )
        client, reader = socket.socketpair()
        client.setblocking(False)
        try:
            fds = _open_fds()
            got = await channel.request(get_meta(), b"")
            assert got.stream is not None
            with pytest.raises(WorkerFailed, match="client's connection failed"):
                async for part in got.stream:
                    assert isinstance(part, LendOffer)
                    await _lend(part, client)
                    await asyncio.sleep(0.05)  # some of the body is in the socket
                    reader.close()  # and the client leaves
            assert _open_fds() == fds - 1  # the reader's end only: the worker's copy closed
            assert worker.replies_lent == 0
        finally:
            client.close()
            await close_pair(channel, serving, sock)

    asyncio.run(run())


def test_a_cancelled_lent_reply_closes_the_descriptor(tmp_path: Path) -> None:
    # The client stops reading, then its request is dropped (the router's client left): the
    # worker waits for room holding no thread, and the cancel closes its descriptor.
    async def run() -> None:
        channel, worker, serving, sock = await open_pair(
            bulk_reply(PARTS), str(tmp_path), str(tmp_path), lend_replies=True
        )
        client, reader = socket.socketpair()
        client.setblocking(False)
        try:
            fds = _open_fds()
            got = await channel.request(get_meta(), b"")
            assert got.stream is not None
            stream = got.stream
            part = await stream.__anext__()
            assert isinstance(part, LendOffer)
            await _lend(part, client)
            await asyncio.sleep(0.2)  # the socket fills; nobody reads
            assert _open_fds() == fds + 1  # the worker's copy of the client socket
            await stream.aclose()  # type: ignore[attr-defined]
            for _ in range(100):
                if _open_fds() == fds:
                    break
                await asyncio.sleep(0.01)
            assert _open_fds() == fds
            assert not worker.tasks
        finally:
            client.close()
            reader.close()
            await close_pair(channel, serving, sock)

    asyncio.run(run())


# -- end to end: serve --workers 1 over the mock engine --------------------------------------


def _lent(gateway: ServerProcess) -> int:
    health = httpx.get(f"{gateway.url}/health", timeout=30).json()
    return int(health["workers"][0]["replies_lent"])


@pytest.mark.procs
def test_the_compiled_front_lends_and_the_connection_serves_on(tmp_path: Path) -> None:
    with mock_engine("--r3-layers", "16", "--r3-topk", "8", "--completion-tokens", "16") as engine:
        for name, args in (
            ("lent", []),
            # Records read back from disk are lent the same way.
            ("lent, records on disk", ["--records-dir", str(tmp_path)]),
            ("python front", ["--front", "python"]),
            ("no-lent", ["--no-lent-replies"]),
        ):
            port = free_port()
            argv = ["serve", "--port", str(port), "--workers", "1", "--r3", "--r3-topk", "8"]
            with ServerProcess([*argv, *args, "--backend", engine.url], port, timeout=60) as gw:
                with httpx.Client(base_url=gw.url, timeout=60) as client:
                    sid = client.post("/sessions").json()["session_id"]
                    messages: list[dict[str, Any]] = [{"role": "user", "content": "word " * 600}]
                    for turn in range(4):
                        reply = client.post(
                            f"/sessions/{sid}/v1/chat/completions", json={"messages": messages}
                        )
                        reply.raise_for_status()
                        messages += [
                            reply.json()["choices"][0]["message"],
                            {"role": "tool", "content": str(turn)},
                        ]
                    # Two GETs and a turn on one kept-alive connection: the front took the
                    # connection back after each lent body.
                    first = client.get(f"/sessions/{sid}")
                    second = client.get(f"/sessions/{sid}")
                    assert first.status_code == second.status_code == 200
                    assert len(first.content) > 1 << 20
                    messages.append({"role": "user", "content": "more"})
                    client.post(
                        f"/sessions/{sid}/v1/chat/completions", json={"messages": messages}
                    ).raise_for_status()
                    assert first.content == second.content
                    # The worker's heartbeat says how many replies it wrote itself.
                    for _ in range(30):
                        lent = _lent(gw)
                        if not name.startswith("lent") or lent >= 2:
                            break
                        time.sleep(0.1)
                    assert lent == (2 if name.startswith("lent") else 0)


def _stalled_lent_get(gw: ServerProcess) -> tuple[socket.socket, int]:
    """A ~45 MiB session, GET by a client that reads nothing: the worker, writing on the
    lent connection, finds it full. The client's socket, and the worker's pid."""
    with httpx.Client(base_url=gw.url, timeout=60) as client:
        sid = client.post("/sessions").json()["session_id"]
        messages: list[dict[str, Any]] = [{"role": "user", "content": "word " * 2000}]
        for turn in range(2):
            reply = client.post(f"/sessions/{sid}/v1/chat/completions", json={"messages": messages})
            reply.raise_for_status()
            messages += [
                reply.json()["choices"][0]["message"],
                {"role": "tool", "content": str(turn)},
            ]
    worker = int(httpx.get(f"{gw.url}/health", timeout=30).json()["workers"][0]["pid"])
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    raw.connect(("127.0.0.1", gw.port))
    raw.sendall(f"GET /sessions/{sid} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
    time.sleep(1.0)  # the head is out, the worker has the socket and it is full
    return raw, worker


def _read_to_eof(raw: socket.socket) -> bytes:
    raw.settimeout(30)  # a cut connection must end, not hang
    received = bytearray()
    while chunk := raw.recv(1 << 20):
        received += chunk
    return bytes(received)


@pytest.mark.procs
def test_a_worker_killed_mid_lent_get_cuts_the_reply() -> None:
    with mock_engine("--r3-layers", "64", "--r3-topk", "32", "--completion-tokens", "16") as engine:
        port = free_port()
        argv = ["serve", "--port", str(port), "--workers", "1", "--r3", "--r3-topk", "32"]
        argv += ["--warm-records-bytes", "0", "--backend", engine.url]
        with ServerProcess(argv, port, timeout=60) as gw:
            raw, worker = _stalled_lent_get(gw)
            with raw:
                os.kill(worker, 9)
                received = _read_to_eof(raw)
            assert received.startswith(b"HTTP/1.1 200")
            assert len(received) > 1 << 20
            assert not received.endswith(b"\r\n0\r\n\r\n")  # cut, never taken as whole
            # The gateway serves on: the replacement worker comes up.
            for _ in range(100):
                if httpx.get(f"{gw.url}/health", timeout=30).status_code == 200:
                    break
                time.sleep(0.1)
            assert httpx.get(f"{gw.url}/health", timeout=30).status_code == 200


@pytest.mark.procs
def test_a_stop_during_a_stalled_lent_get_ends_both() -> None:
    with mock_engine("--r3-layers", "64", "--r3-topk", "32", "--completion-tokens", "16") as engine:
        port = free_port()
        argv = ["serve", "--port", str(port), "--workers", "1", "--r3", "--r3-topk", "32"]
        argv += ["--warm-records-bytes", "0", "--backend", engine.url]
        with ServerProcess(argv, port, timeout=60) as gw:
            assert gw.proc is not None
            raw, _ = _stalled_lent_get(gw)
            with raw:
                stopped = time.monotonic()
                gw.proc.send_signal(15)
                gw.proc.wait(timeout=30)
                received = _read_to_eof(raw)
            assert time.monotonic() - stopped < 30
            assert received.startswith(b"HTTP/1.1 200")
            assert not received.endswith(b"\r\n0\r\n\r\n")

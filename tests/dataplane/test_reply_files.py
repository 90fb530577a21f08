"""Bulk reply bodies handed from a local worker to the router as shared-memory file
segments (dataplane/transport/reply_files.py): the same bytes as frames, nothing left behind
on any path (done, cancelled, refused, directory full), and names that cannot leave the
directory.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import socket
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessiongate.dataplane.router.worker_channel import WorkerFailed
from sessiongate.dataplane.transport import reply_files
from sessiongate.dataplane.transport.reply_files import open_segment
from sessiongate.dataplane.worker.loop import _gather
from sessiongate.protocol import CoreReply, FilePart
from support.dataplane import reply_dir_of
from support.procs import ServerProcess, free_port, mock_engine
from support.worker_pair import bulk_reply, close_pair, get_meta, open_pair

# The end-to-end tests below start gateways.
pytestmark = pytest.mark.procs

PARTS = [bytes([n]) * size for n, size in enumerate((9 << 20, 5, 700_000, 1 << 20))]
BODY = b"".join(PARTS)


async def _read(stream: AsyncIterator[bytes | FilePart], kinds: list[str]) -> bytes:
    out = bytearray()
    async for part in stream:
        if isinstance(part, FilePart):
            kinds.append("file")
            out += b"".join([chunk async for chunk in part])
        else:
            kinds.append("bytes")
            out += part
    return bytes(out)


async def _fetch(
    reply: CoreReply, worker_dir: str | None, router_dir: str | None, kinds: list[str]
) -> bytes:
    channel, _, serving, sock = await open_pair(reply, worker_dir, router_dir)
    try:
        got = await channel.request(get_meta(), b"")
        assert got.status == 200 and got.stream is not None
        return await _read(got.stream, kinds)
    finally:
        await close_pair(channel, serving, sock)


def test_a_bulk_reply_crosses_as_file_segments_and_leaves_nothing(tmp_path: Path) -> None:
    kinds: list[str] = []
    body = asyncio.run(_fetch(bulk_reply(PARTS), str(tmp_path), str(tmp_path), kinds))
    assert body == BODY
    # 4 MiB segments: three of them for ~10.7 MiB, the last one short.
    assert kinds == ["file"] * -(-len(BODY) // reply_files.SEGMENT)
    assert not list(tmp_path.iterdir())  # each unlinked as soon as the router opened it


def test_without_a_directory_the_reply_goes_as_frames(tmp_path: Path) -> None:
    kinds: list[str] = []
    assert asyncio.run(_fetch(bulk_reply(PARTS), None, str(tmp_path), kinds)) == BODY
    assert set(kinds) == {"bytes"}


def test_a_router_without_the_directory_refuses_file_segments(tmp_path: Path) -> None:
    # A worker that is not the router's child (a remote one) must not make it open files.
    with pytest.raises(WorkerFailed, match="not this router's child"):
        asyncio.run(_fetch(bulk_reply(PARTS), str(tmp_path), None, []))


def test_a_full_directory_turns_the_rest_into_frames_with_every_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_writev = os.writev
    written = 0

    def writev(fd: int, data: Any) -> int:
        nonlocal written
        if written >= reply_files.SEGMENT:  # the second segment finds the directory full
            raise OSError(errno.ENOSPC, "No space left on device")
        n = real_writev(fd, data)
        written += n
        return n

    monkeypatch.setattr(reply_files.os, "writev", writev)
    kinds: list[str] = []
    assert asyncio.run(_fetch(bulk_reply(PARTS), str(tmp_path), str(tmp_path), kinds)) == BODY
    assert kinds[0] == "file" and set(kinds[1:]) == {"bytes"}
    assert not list(tmp_path.iterdir())


def test_a_directory_that_is_gone_means_frames(tmp_path: Path) -> None:
    gone = tmp_path / "removed"
    kinds: list[str] = []
    assert asyncio.run(_fetch(bulk_reply(PARTS), str(gone), str(tmp_path), kinds)) == BODY
    assert set(kinds) == {"bytes"}


def test_a_cancelled_request_leaves_no_file(tmp_path: Path) -> None:
    async def run() -> None:
        reply = bulk_reply(PARTS, pause=0.05)
        channel, _, serving, sock = await open_pair(reply, str(tmp_path), str(tmp_path))
        try:
            got = await channel.request(get_meta(), b"")
            assert got.stream is not None
            stream = aiter(got.stream)
            first = await anext(stream)  # then the consumer leaves
            assert isinstance(first, FilePart)
            await stream.aclose()  # type: ignore[attr-defined]
            for _ in range(100):
                await asyncio.sleep(0.02)
                if not list(tmp_path.iterdir()):
                    break
        finally:
            await close_pair(channel, serving, sock)

    asyncio.run(run())
    assert not list(tmp_path.iterdir())


def _frame(name: object, length: object) -> bytes:
    return json.dumps({"file": name, "length": length}).encode()


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (_frame("../escape", 3), "bad reply file name"),
        (_frame("a/b", 3), "bad reply file name"),
        (_frame("..", 3), "bad reply file name"),
        (_frame(7, 3), "bad reply file name"),
        (_frame("missing", 3), "cannot be opened"),
        (_frame("present", True), "bad reply file length"),
        (_frame("present", -1), "bad reply file length"),
        (_frame("present", 4), "holds 3 bytes, not the 4 announced"),
        (b"not json", "bad BODY_FILE frame"),
        (b'{"file": "present"}', "bad BODY_FILE frame"),
    ],
)
def test_segment_frames_are_checked(tmp_path: Path, payload: bytes, message: str) -> None:
    (tmp_path / "present").write_bytes(b"abc")
    outside = tmp_path.parent / "escape"
    outside.write_bytes(b"abc")
    try:
        with pytest.raises(ValueError, match=message):
            open_segment(str(tmp_path), payload)
    finally:
        outside.unlink()


def test_a_file_part_is_taken_once_and_cut_when_short(tmp_path: Path) -> None:
    path = tmp_path / "short"
    path.write_bytes(b"abc")
    part = open_segment(str(tmp_path), _frame("short", 3))
    os.close(part.take_fd())
    with pytest.raises(ValueError, match="already taken"):
        part.take_fd()
    path.write_bytes(b"abc")
    part = FilePart(os.open(path, os.O_RDONLY), 10)

    async def read() -> bytes:
        return b"".join([c async for c in part])

    with pytest.raises(ConnectionError, match="ended at 3 of 10 bytes"):
        asyncio.run(read())


# -- end to end: serve --workers 1 over the mock engine, both fronts ----------------------


def _scrub(value: Any) -> Any:
    """A GET document without what differs between gateways (ids, clocks) or between runs
    on one engine (its prefix cache warms)."""
    volatile = {"id", "created", "timestamp", "request_timestamp", "e2e_latency", "session_id"}
    volatile |= {"response_sent_to_client_ts", "parent_session_id"}
    volatile |= {"cached_tokens", "cached_tokens_details"}
    if isinstance(value, dict):
        return {k: _scrub(v) for k, v in value.items() if k not in volatile}
    if isinstance(value, list):
        return [_scrub(v) for v in value]
    return value


@pytest.fixture(scope="module")
def engine() -> Iterator[ServerProcess]:
    # 16 layers x top-8 of R3 over ~600-token turns: a session's records pass 1 MiB (~2 MB),
    # so its GET is a bulk stream.
    with mock_engine("--r3-layers", "16", "--r3-topk", "8", "--completion-tokens", "16") as proc:
        yield proc


def _session_get(url: str) -> bytes:
    prompt = " ".join(["word"] * 600)
    with httpx.Client(base_url=url, timeout=60) as client:
        sid = client.post("/sessions").json()["session_id"]
        messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
        for turn in range(4):
            reply = client.post(f"/sessions/{sid}/v1/chat/completions", json={"messages": messages})
            reply.raise_for_status()
            messages += [
                reply.json()["choices"][0]["message"],
                {"role": "tool", "content": str(turn)},
            ]
        got = client.get(f"/sessions/{sid}")
        got.raise_for_status()
        return got.content


def test_records_get_is_the_same_through_files_frames_and_fronts(engine: ServerProcess) -> None:
    documents = {}
    for name, args in (
        ("in-process", ["--workers", "0"]),
        ("compiled", ["--workers", "1"]),
        ("python", ["--workers", "1", "--front", "python"]),
        ("frames", ["--workers", "1", "--no-shared-memory-replies"]),
    ):
        port = free_port()
        argv = [
            "serve",
            "--port",
            str(port),
            *args,
            "--r3",
            "--r3-topk",
            "8",
            "--backend",
            engine.url,
        ]
        with ServerProcess(argv, port, timeout=60) as gateway:
            directory = reply_dir_of(gateway) if name in ("compiled", "python") else None
            if name == "frames":
                assert reply_dir_of(gateway) is None  # the option turns the files off
            body = _session_get(gateway.url)
            assert len(body) > 1 << 20
            documents[name] = _scrub(json.loads(body))
            if directory is not None:
                assert directory.is_dir() and not list(directory.iterdir())
        if directory is not None:
            assert not directory.exists()  # removed at stop
    assert documents["compiled"] == documents["in-process"] == documents["python"]
    assert documents["frames"] == documents["compiled"]


def test_a_client_gone_mid_get_leaks_no_descriptor(engine: ServerProcess) -> None:
    port = free_port()
    argv = ["serve", "--port", str(port), "--workers", "1", "--r3", "--r3-topk", "8"]
    with ServerProcess([*argv, "--backend", engine.url], port, timeout=60) as gateway:
        directory = reply_dir_of(gateway)
        assert directory is not None
        body = _session_get(gateway.url)
        sid = json.loads(body)["session_id"]
        assert gateway.proc is not None
        children = Path(f"/proc/{gateway.proc.pid}/task/{gateway.proc.pid}/children").read_text()
        router = next(
            pid
            for pid in children.split()
            if b"_router" in Path(f"/proc/{pid}/cmdline").read_bytes()
        )
        before = len(os.listdir(f"/proc/{router}/fd"))
        for _ in range(5):
            with socket.create_connection(("127.0.0.1", port)) as raw:
                raw.sendall(f"GET /sessions/{sid} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
                raw.recv(1024)  # the head and a little: then gone
        with httpx.Client(base_url=gateway.url, timeout=30) as client:
            for _ in range(50):
                if len(os.listdir(f"/proc/{router}/fd")) <= before:
                    break
                client.get("/health")
        assert len(os.listdir(f"/proc/{router}/fd")) <= before
        assert not list(directory.iterdir())
        assert httpx.get(f"{gateway.url}/sessions/{sid}", timeout=30).content == body


def _dechunk(data: bytes) -> bytes:
    body, rest = bytearray(), data
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return bytes(body)
        body += rest[:size]
        rest = rest[size + 2 :]


def test_a_slow_reader_gets_every_byte(engine: ServerProcess) -> None:
    # A client that reads slower than the front sends fills its socket: the front's bulk
    # thread then finds it full and the connection waits for room (the path where a lost
    # wake-up would hang the GET for ever; the socket timeout turns that into a failure).
    port = free_port()
    argv = ["serve", "--port", str(port), "--workers", "1", "--r3", "--r3-topk", "8"]
    with ServerProcess([*argv, "--backend", engine.url], port, timeout=60) as gateway:
        body = _session_get(gateway.url)
        sid = json.loads(body)["session_id"]
        for _ in range(2):
            with socket.socket() as raw:
                raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                raw.settimeout(30)
                raw.connect(("127.0.0.1", port))
                request = f"GET /sessions/{sid} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
                raw.sendall(request.encode())
                received = bytearray()
                while chunk := raw.recv(16 << 10):
                    received += chunk
                    time.sleep(0.001)
            head, _, payload = bytes(received).partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200")
            chunked = b"transfer-encoding: chunked" in head.lower()
            assert (_dechunk(payload) if chunked else payload) == body


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=300), max_size=12),
    st.integers(min_value=1, max_value=64),
    st.integers(min_value=1, max_value=40),
)
def test_segments_gather_views_without_copying_large_parts(
    sizes: list[int], limit: int, small: int
) -> None:
    parts = [bytes([n % 251]) * size for n, size in enumerate(sizes)]

    async def stream() -> AsyncIterator[bytes]:
        for part in parts:
            yield part

    async def run() -> list[list[memoryview]]:
        return [segment async for segment in _gather(stream(), limit, small)]

    segments = asyncio.run(run())
    assert b"".join(bytes(v) for segment in segments for v in segment) == b"".join(parts)
    lengths = [sum(len(v) for v in segment) for segment in segments]
    assert all(n == limit for n in lengths[:-1]) and all(0 < n <= limit for n in lengths)
    views = [view for segment in segments for view in segment]
    offset = 0
    for part in parts:
        whole = offset // limit == (offset + len(part) - 1) // limit  # within one segment
        if len(part) >= small and whole:  # sent as the part's own memory, not a copy
            assert sum(1 for view in views if view.obj is part and len(view) == len(part)) == 1
        offset += len(part)
    for view in views:  # a piece of a part is never under `small`; joined copies may be
        if any(view.obj is part for part in parts):
            assert len(view) >= small


def test_a_segment_survives_short_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_writev = os.writev

    def writev(fd: int, data: Any) -> int:  # at most 5 bytes a call, as a busy disk might
        return real_writev(fd, [bytes(b"".join(bytes(v) for v in data)[:5])])

    monkeypatch.setattr(reply_files.os, "writev", writev)
    views = [memoryview(b"abc"), memoryview(b""), memoryview(b"defghijkl"), memoryview(b"m")]
    name = asyncio.run(reply_files.write_segment(str(tmp_path), views, "t"))
    assert name is not None
    assert (tmp_path / name).read_bytes() == b"abcdefghijklm"


def test_concurrent_gets_get_every_byte() -> None:
    # Sessions of ~45 MiB (a dozen 4 MiB segments each), GET by four clients at once, twice:
    # every body must be the first GET's bytes. (A build that wrote segment files again once
    # the front had closed them failed here: `sendfile` leaves the file's pages in the
    # socket's buffers until the client reads them, and they were overwritten on their way.)
    with mock_engine("--r3-layers", "64", "--r3-topk", "32", "--completion-tokens", "16") as engine:
        port = free_port()
        argv = ["serve", "--port", str(port), "--workers", "1", "--r3", "--r3-topk", "32"]
        with ServerProcess([*argv, "--backend", engine.url], port, timeout=60) as gateway:
            directory = reply_dir_of(gateway)
            assert directory is not None
            with httpx.Client(base_url=gateway.url, timeout=60) as client:
                sid = client.post("/sessions").json()["session_id"]
                messages: list[dict[str, Any]] = [{"role": "user", "content": "word " * 2000}]
                for turn in range(2):
                    reply = client.post(
                        f"/sessions/{sid}/v1/chat/completions", json={"messages": messages}
                    )
                    reply.raise_for_status()
                    messages += [
                        reply.json()["choices"][0]["message"],
                        {"role": "tool", "content": str(turn)},
                    ]
                first = client.get(f"/sessions/{sid}").content
            assert len(first) > 8 * reply_files.SEGMENT

            def get() -> bytes:
                with httpx.Client(base_url=gateway.url, timeout=60) as reader:
                    return reader.get(f"/sessions/{sid}").content

            with ThreadPoolExecutor(4) as pool:
                for _ in range(2):
                    bodies = list(pool.map(lambda _: get(), range(4)))
                    assert all(body == first for body in bodies)
            assert not list(directory.iterdir())

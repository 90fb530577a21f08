"""Bulk reply bodies (records GETs) that a local worker writes on the client's connection
itself, lent by the compiled front for the body: the router and the front never touch the
bytes, and nothing goes through tmpfs.

Through shared-memory segments (reply_files.py) a MiB of GET cost the worker a fresh tmpfs
file (0.45-0.47 ms of CPU: the page allocation, not the copy) and the front its `sendfile`
(0.32-0.39 ms). Written on the client's socket from the records' own memory, a MiB costs one
copy into the socket: 0.24-0.29 ms in all, measured with two processes on loopback, against
0.91-1.15 ms through a tmpfs file and 0.59-1.24 through a pipe spliced on
(benches/scenarios/body_paths.py).

How a body is lent (docs/ipc.md, "Lent connections"):

1. The worker listens on a UNIX socket in the reply directory (private to the gateway) and
   sends a BODY_LEND frame naming it, before any byte of the body.
2. The router hands the offer on as a `LendOffer` part. The compiled front writes the head,
   connects, and sends one byte with its client socket (`SCM_RIGHTS`); a front that cannot
   lend (the Python fronts, a reply that is not chunked) sends the refusal byte alone.
3. Lent, the worker writes the body as HTTP/1.1 chunks on its own descriptor of the
   socket, closes it, and sends END; the front writes the last chunk and serves the
   connection's next request. Refused, the worker sends the body as segments or frames.

The socket stays non-blocking (the front's runtime needs it so), so the worker sends what the
socket takes, 1 MiB at a time in a niced thread, and waits for room on its event loop: a
client that stops reading holds no thread, only its records, as a stalled reader of
segments does. Before each MiB it pauses while the CPU is contended, as the front does
before its file parts (front/cpu_pressure.py): four clients GETting 711 MiB each at once got
1,455 MiB/s with small chats' p99 at 9.5 ms meanwhile, against 2,444 MiB/s and 23.8 ms
without the pause (files: 615 MiB/s, 16.6 ms).

A client gone fails the request with an ERROR frame (the front cuts the connection); a
cancel (the router's client left) closes the worker's descriptor, and the front shuts a cut
connection down so that no descriptor still open in a worker keeps it open.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from sessiongate.dataplane.transport.reply_files import lower_priority
from sessiongate.front.cpu_pressure import yield_to_busy_cpu
from sessiongate.protocol import LendOffer

# The byte that comes with a lent socket: write the body as chunks (rust/front/lend.rs).
LEND_CHUNKED = b"c"
# How long a worker waits for the front's answer before sending the body the usual way. The
# front answers as soon as the head is out; a router that dropped the request cancels it.
ANSWER_TIMEOUT = 30.0
# Bytes per chunk of the reply: the frames' chunk size, as the front's file parts.
CHUNK = 256 << 10
# Bytes per turn of the sender thread, between checks of the CPU's pressure (the front's
# slice for file parts).
SLICE = 1 << 20
# Views per sendmsg call (Linux's IOV_MAX is 1024).
SEND_MAX = 512


class ClientGone(Exception):
    """The client's connection failed while the worker wrote the body."""


# At the segment writer's niceness (reply_files.py): it yields the cores to the event loops
# that serve small requests.
_SENDER = ThreadPoolExecutor(1, thread_name_prefix="sg-lent", initializer=lower_priority)


def offer_frame(name: str) -> bytes:
    return json.dumps({"socket": name}, separators=(",", ":")).encode()


def open_offer(directory: str | None, payload: bytes) -> LendOffer:
    """The offer a BODY_LEND frame makes; ValueError saying what is wrong."""
    if directory is None:
        raise ValueError("a lent reply from a worker that is not this router's child")
    try:
        name = json.loads(payload)["socket"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"bad BODY_LEND frame {payload[:80]!r}") from None
    if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
        raise ValueError(f"bad lent reply socket name {name!r}")
    return LendOffer(os.path.join(directory, name))


class Listener:
    """The worker's end of one offer: a UNIX socket in the reply directory, removed on
    `close` whatever happened."""

    def __init__(self, directory: str, tag: str) -> None:
        self.name = f"{os.getpid()}-{tag}-{secrets.token_hex(6)}.lend"
        self.path = os.path.join(directory, self.name)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.sock.setblocking(False)
        try:
            self.sock.bind(self.path)
            self.sock.listen(1)
        except OSError:
            self.close()
            raise

    async def answer(self, timeout: float = ANSWER_TIMEOUT) -> int | None:
        """The lent socket's descriptor (the caller owns it), or None: refused, no answer in
        time, or an answer that is neither."""
        loop = asyncio.get_running_loop()
        try:
            peer, _ = await asyncio.wait_for(loop.sock_accept(self.sock), timeout)
        except (TimeoutError, OSError):
            return None
        with peer:
            try:
                await asyncio.wait_for(_readable(loop, peer.fileno()), timeout)
                message, fds, _, _ = socket.recv_fds(peer, 1, 1)
            except (TimeoutError, OSError):
                return None
        if message == LEND_CHUNKED and len(fds) == 1:
            return fds[0]
        for fd in fds:  # a refusal (LEND_REFUSED) carries none
            os.close(fd)
        return None

    def close(self) -> None:
        self.sock.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


async def write_chunks(fd: int, segments: AsyncIterator[list[memoryview]]) -> None:
    """Write the segments as HTTP/1.1 chunks of CHUNK bytes on the lent socket `fd`, then
    close `fd` (always). ClientGone when the client's connection failed."""
    loop = asyncio.get_running_loop()
    try:
        async for segment in segments:
            views = chunked(segment, CHUNK)
            while views:
                # As the front's file parts: a pause while the CPU is contended, so a GET
                # takes the spare CPU and small requests keep their latency.
                await yield_to_busy_cpu()
                sending = loop.run_in_executor(_SENDER, _send_some, fd, views, SLICE)
                try:
                    views = await asyncio.shield(sending)
                except asyncio.CancelledError:
                    # The thread must be done with `fd` before it is closed.
                    await asyncio.wait({sending})
                    raise
                if views:
                    await _writable(loop, fd)
    finally:
        os.close(fd)


def chunked(segment: Sequence[memoryview], chunk: int) -> list[memoryview]:
    """`segment` as HTTP/1.1 chunks of `chunk` bytes (the last may be shorter): size lines
    and CRLFs between views of the segment's own bytes, nothing copied. (Clients that decode
    chunks in Python take far longer over multi-MiB chunks, so the size is the frames'.)"""
    left = sum(len(view) for view in segment)
    views: list[memoryview] = []
    room = 0
    for view in segment:
        while view:
            if not room:
                room = min(chunk, left)
                views.append(memoryview(b"%x\r\n" % room))
            piece = view[:room]
            views.append(piece)
            view = view[len(piece) :]
            room -= len(piece)
            left -= len(piece)
            if not room:
                views.append(_CRLF)
    return views


_CRLF = memoryview(b"\r\n")


def _send_some(fd: int, views: Sequence[memoryview], budget: int) -> list[memoryview]:
    """Send what the socket takes now, up to about `budget` bytes; the views still to send
    (empty when all went). Runs in the sender thread; the GIL is released during each send."""
    left = [view for view in views if view]
    sock = socket.socket(fileno=fd)
    try:
        # Non-blocking as the front's runtime set it (one file description for both): a
        # full socket raises here rather than waiting in this thread.
        sock.settimeout(0.0)
        while left and budget > 0:
            batch: list[memoryview] = []
            size = 0
            for view in left[:SEND_MAX]:
                if batch and size + len(view) > budget:
                    break
                batch.append(view)
                size += len(view)
            try:
                sent = sock.sendmsg(batch, [], socket.MSG_NOSIGNAL)
            except BlockingIOError:
                return left
            except OSError as exc:
                raise ClientGone(f"the client's connection failed: {exc.strerror}") from None
            budget -= sent
            while sent and sent >= len(left[0]):
                sent -= len(left.pop(0))
            if sent:
                left[0] = left[0][sent:]
        return left
    finally:
        sock.detach()  # `fd` stays open: write_chunks closes it


async def _writable(loop: asyncio.AbstractEventLoop, fd: int) -> None:
    await _ready(loop.add_writer, loop.remove_writer, fd)


async def _readable(loop: asyncio.AbstractEventLoop, fd: int) -> None:
    await _ready(loop.add_reader, loop.remove_reader, fd)


async def _ready(add: Callable[..., None], remove: Callable[[int], object], fd: int) -> None:
    """Until the event loop reports `fd` ready (`add`: the loop's add_reader/add_writer)."""
    waiter = asyncio.get_running_loop().create_future()
    add(fd, _wake, waiter)
    try:
        await waiter
    finally:
        remove(fd)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)

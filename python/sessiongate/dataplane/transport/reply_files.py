"""Bulk reply bodies (records GETs) handed from a local worker to the router as files in
shared memory, so the router never touches their bytes.

Through frames, every byte of a records GET crossed the router's process twice (the kernel's
copy in from the worker's socket, the decoder's copy into a payload) plus Python per frame:
0.39-0.45 ms of router CPU per MiB, against a goal of 0.2. Here the worker writes the body in
segments of SEGMENT bytes, each a file in a directory on tmpfs that `serve` creates for its
children (`/dev/shm`), and sends one BODY_FILE frame naming each, paced by the same credit
as BODY frames (at most CREDIT_WINDOW + 1 segments on tmpfs per reply). The router opens each
file and unlinks it at once (nothing is left behind whatever happens next) and hands it on
as a `FilePart`: the compiled front `sendfile`s it to the client (the kernel's one copy, on
a niced thread of the front's; nothing per byte in Python), the Python front reads it. While
the front sends one segment the worker writes the next. A segment is a list of views of the
records' own bytes, written with one `writev`: nothing is joined on the event loop.
`serve --no-shared-memory-replies` turns files off. docs/ipc.md, "File segments".

Only channels the router opened to its own children accept BODY_FILE (a remote worker naming
a file is refused), and a name must be a plain file name inside the directory. A worker whose
directory is full sends the rest of that reply as BODY frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import secrets
import shutil
import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sessiongate.protocol import FilePart

# Where tmpfs usually is on Linux; elsewhere (or when it is missing) file segments are off.
SHARED_MEMORY = Path("/dev/shm")
# Free space a directory must have to be used at all (a full one costs nothing but the
# fallback to frames).
MIN_FREE = 64 << 20
# Bytes per segment file: per-file costs (create, frame, open, unlink) stay under 0.03 ms
# per MiB, and the front sends one segment while the worker writes the next.
SEGMENT = 4 << 20
# Write errors that mean "the directory is full": the reply goes on as frames.
FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# Views per writev call (Linux's IOV_MAX is 1024).
WRITEV_MAX = 512
# The segment writer's niceness (see _WRITER).
WRITER_NICE = 10


def make_reply_dir() -> str | None:
    """A private directory for file segments, or None when shared memory is not usable."""
    try:
        stats = os.statvfs(SHARED_MEMORY)
        if stats.f_bavail * stats.f_frsize < MIN_FREE:
            return None
        return tempfile.mkdtemp(prefix="sessiongate-replies-", dir=SHARED_MEMORY)
    except OSError:
        return None


def remove_reply_dir(directory: str | None) -> None:
    if directory:
        shutil.rmtree(directory, ignore_errors=True)


async def write_segment(directory: str, data: Sequence[memoryview], tag: str) -> str | None:
    """The views of `data`, in order, as a new file of `directory`; its name, or None when no
    file can be made or the directory is full.
    The copy (and tmpfs's page faults) run in the writer thread, so the worker's event loop
    keeps serving small requests meanwhile. The file is removed on any failure or cancellation."""
    name = f"{os.getpid()}-{tag}-{secrets.token_hex(6)}"
    path = os.path.join(directory, name)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError:  # no inode left, the directory gone, no descriptor left: frames then
        return None
    done = False
    writing = asyncio.get_running_loop().run_in_executor(_WRITER, _write_all, fd, data)
    try:
        try:
            full = not await asyncio.shield(writing)
        except asyncio.CancelledError:
            # The thread must be done with `fd` before it is closed (and its number reused).
            await asyncio.wait({writing})
            raise
        if full:
            return None
        done = True
        return name
    finally:
        os.close(fd)
        if not done:
            with contextlib.suppress(OSError):
                os.unlink(path)


def lower_priority() -> None:
    """Lower the calling thread's priority to WRITER_NICE (for the threads that copy bulk
    bodies: this one, and the sender of lent replies)."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)


# One thread per worker writes the segments, at a lower priority: the copy and tmpfs's page
# faults (fresh pages each segment) then yield the cores to the event loops that serve small
# requests. (Measured on 2 cores, four 711 MiB GETs with small chats meanwhile: their p99
# was 62-78 ms with writes in the default executor, 43 ms with the writer niced, 27-33 ms
# once segments were gathered as views and the front's sends had their own niced thread.)
_WRITER = ThreadPoolExecutor(1, thread_name_prefix="sg-segments", initializer=lower_priority)


def _write_all(fd: int, data: Sequence[memoryview]) -> bool:
    """False when the file system is full."""
    views = [view for view in data if view]
    while views:
        try:
            written = os.writev(fd, views[:WRITEV_MAX])
        except OSError as exc:
            if exc.errno in FULL:
                return False
            raise
        while written and written >= len(views[0]):
            written -= len(views.pop(0))
        if written:
            views[0] = views[0][written:]
    return True


def segment_frame(name: str, length: int) -> bytes:
    return json.dumps({"file": name, "length": length}, separators=(",", ":")).encode()


def open_segment(directory: str | None, payload: bytes) -> FilePart:
    """The segment a BODY_FILE frame names, opened and unlinked; ValueError saying what is
    wrong (the frame, the name, the file)."""
    if directory is None:
        raise ValueError("a file segment from a worker that is not this router's child")
    try:
        frame = json.loads(payload)
        name, length = frame["file"], frame["length"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"bad BODY_FILE frame {payload[:80]!r}") from None
    if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
        raise ValueError(f"bad reply file name {name!r}")
    if not isinstance(length, int) or isinstance(length, bool) or length < 0:
        raise ValueError(f"bad reply file length {length!r}")
    path = os.path.join(directory, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        raise ValueError(f"reply file {name} cannot be opened: {exc.strerror}") from None
    with contextlib.suppress(OSError):
        os.unlink(path)
    size = os.fstat(fd).st_size
    if size != length:
        os.close(fd)
        raise ValueError(f"reply file {name} holds {size} bytes, not the {length} announced")
    return FilePart(fd, length)


def discard_segment(directory: str | None, payload: bytes) -> None:
    """Remove the segment of a BODY_FILE frame nobody will read (its request is gone)."""
    with contextlib.suppress(ValueError):
        open_segment(directory, payload).close()

"""Bulk reply bodies (records GETs) handed from a local worker to the router as files in
shared memory, so the router never touches their bytes.

Through frames, every byte of a records GET crossed the router's process twice (the kernel's
copy in from the worker's socket, the decoder's copy into a payload) plus Python per frame:
0.39-0.45 ms of router CPU per MiB, against a goal of 0.2. Here the worker writes the body in
segments of SEGMENT bytes, each a file in a directory on tmpfs that `serve` creates for its
children (`/dev/shm`), and sends one BODY_FILE frame naming each, paced by the same credit
as BODY frames (at most CREDIT_WINDOW + 1 segments in flight per reply). The router opens each
file and unlinks it at once (nothing is left behind whatever happens next) and hands it on
as a `FilePart`: the compiled front `sendfile`s it to the client (the kernel's one copy, on
a niced thread of the front's; nothing per byte in Python), the Python front reads it. While
the front sends one segment the worker writes the next. A segment is a list of views of the
records' own bytes, written with one `writev`: nothing is joined on the event loop.
`serve --no-shared-memory-replies` turns files off. docs/ipc.md, "File segments".

A worker reuses its segment files (`SegmentPool`): writing into a new tmpfs file costs the
kernel fresh pages, 0.39 ms of CPU per MiB on this machine kind, where overwriting a file's
pages costs the copy alone, 0.08 ms. Each pooled file has a second link in `pool/`, so it
outlives the router's unlink, and a lock says when it is free again: the router takes a
shared `flock` before it unlinks the name a frame gave, and the lock holds until the front
closes its last descriptor. A file the router has unlinked (one link left) whose exclusive
lock the worker gets is read by nobody and is written again.

Only channels the router opened to its own children accept BODY_FILE (a remote worker naming
a file is refused), and a name must be a plain file name inside the directory. A worker whose
directory is full sends the rest of that reply as BODY frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import os
import secrets
import shutil
import stat
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


# The subdirectory of a reply directory where workers keep the second link of their pooled
# segment files.
POOL_DIR = "pool"
# Files a worker keeps for reuse: the segments of two replies in flight (CREDIT_WINDOW + 1
# each), at most a sixteenth of the file system's size (a container's 64 MiB /dev/shm keeps
# one), so pooled files never crowd out the segments they would be reused for.
POOL_FILES = 18
POOL_SHARE = 16


class _Pooled:
    """A segment file a worker keeps: its descriptor and its link in `pool/`."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd
        self.path = path
        self.busy = False

    def free(self) -> bool:
        """Read by nobody: the router unlinked the name it was given, and no descriptor of
        the router's or the front's holds the shared lock. Takes the exclusive lock then."""
        if self.busy or os.fstat(self.fd).st_nlink != 1:
            return False
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        self.busy = True
        return True

    def release(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        self.busy = False


class SegmentPool:
    """A worker's segment files in `directory`, kept and written again once read (see the
    module's docstring); files beyond what it keeps are made for one segment, as before."""

    def __init__(self, directory: str, keep: int | None = None) -> None:
        self.directory = directory
        self.pool_dir = os.path.join(directory, POOL_DIR)
        self.keep = _pool_size(directory) if keep is None else keep
        self.files: list[_Pooled] = []
        self.reused = 0
        if self.keep:
            try:
                os.makedirs(self.pool_dir, exist_ok=True)
                _remove_orphans(self.pool_dir)
            except OSError:  # the directory is gone: nothing to keep, write() says so
                self.keep = 0

    async def write(self, data: Sequence[memoryview], tag: str) -> str | None:
        """The views of `data`, in order, as a file of the directory; its name, or None when
        no file can be made or the directory is full.
        The copy (and tmpfs's page faults) run in the writer thread, so the worker's event
        loop keeps serving small requests meanwhile. On any failure or cancellation the name
        is never linked (a pooled file stays in the pool)."""
        name = f"{os.getpid()}-{tag}-{secrets.token_hex(6)}"
        path = os.path.join(self.directory, name)
        pooled = self._take()
        if pooled is None:
            return await _write_new(path, data)
        try:
            if not await _write_in_thread(pooled.fd, data, rewrite=True):
                return None
            os.link(pooled.path, path)
        except OSError:  # the directory gone, or full: frames then
            return None
        finally:
            pooled.release()
        return name

    def _take(self) -> _Pooled | None:
        for pooled in self.files:
            if pooled.free():
                self.reused += 1
                return pooled
        if len(self.files) >= self.keep:
            return None
        path = os.path.join(self.pool_dir, f"{os.getpid()}-{secrets.token_hex(6)}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError:
            return None
        pooled = _Pooled(fd, path)
        fcntl.flock(fd, fcntl.LOCK_EX)  # a new file: nobody else has it
        pooled.busy = True
        self.files.append(pooled)
        return pooled

    def close(self) -> None:
        """Unlink the kept files (the worker is ending): a file a front still sends stays
        readable through its descriptor, and one being written is closed with the process
        (closing it under the writer thread could hand its number to another file)."""
        for pooled in self.files:
            with contextlib.suppress(OSError):
                os.unlink(pooled.path)
            if not pooled.busy:
                os.close(pooled.fd)
        self.files.clear()
        self.keep = 0
        with contextlib.suppress(OSError):  # another worker's files still there
            os.rmdir(self.pool_dir)


def _pool_size(directory: str) -> int:
    try:
        stats = os.statvfs(directory)
    except OSError:
        return 0
    return max(0, min(POOL_FILES, stats.f_blocks * stats.f_frsize // (POOL_SHARE * SEGMENT)))


def _remove_orphans(pool_dir: str) -> None:
    """Pooled files of workers that are gone (a worker killed before its close)."""
    for name in os.listdir(pool_dir):
        pid = name.split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(pool_dir, name))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def _write_new(path: str, data: Sequence[memoryview]) -> str | None:
    """A segment in a file of its own, freed once read."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError:  # no inode left, the directory gone, no descriptor left: frames then
        return None
    done = False
    try:
        done = await _write_in_thread(fd, data, rewrite=False)
        return os.path.basename(path) if done else None
    finally:
        os.close(fd)
        if not done:
            with contextlib.suppress(OSError):
                os.unlink(path)


async def _write_in_thread(fd: int, data: Sequence[memoryview], *, rewrite: bool) -> bool:
    """False when the file system is full."""
    writing = asyncio.get_running_loop().run_in_executor(_WRITER, _write_file, fd, data, rewrite)
    try:
        return await asyncio.shield(writing)
    except asyncio.CancelledError:
        # The thread must be done with `fd` before it is closed (and its number reused).
        await asyncio.wait({writing})
        raise


def _write_file(fd: int, data: Sequence[memoryview], rewrite: bool) -> bool:
    """The views in order at the file's start; a reused file is cut to them."""
    if rewrite:
        os.lseek(fd, 0, os.SEEK_SET)
    if not _write_all(fd, data):
        return False
    if rewrite:
        os.ftruncate(fd, os.lseek(fd, 0, os.SEEK_CUR))
    return True


def _lower_priority() -> None:
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)


# One thread per worker writes the segments, at a lower priority: the copy and tmpfs's page
# faults (fresh pages each segment) then yield the cores to the event loops that serve small
# requests. (Measured on 2 cores, four 711 MiB GETs with small chats meanwhile: their p99
# was 62-78 ms with writes in the default executor, 43 ms with the writer niced, 27-33 ms
# once segments were gathered as views and the front's sends had their own niced thread.)
_WRITER = ThreadPoolExecutor(1, thread_name_prefix="sg-segments", initializer=_lower_priority)


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
    # Held until the last descriptor of this open file closes (the front's duplicates
    # included): the worker writes a pooled file again only once it can lock it alone.
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise ValueError(f"reply file {name} is still being written") from None
    with contextlib.suppress(OSError):
        os.unlink(path)
    stats = os.fstat(fd)
    if not stat.S_ISREG(stats.st_mode):  # e.g. the pool's directory
        os.close(fd)
        raise ValueError(f"reply file {name} is not a regular file")
    size = stats.st_size
    if size != length:
        os.close(fd)
        raise ValueError(f"reply file {name} holds {size} bytes, not the {length} announced")
    return FilePart(fd, length)


def discard_segment(directory: str | None, payload: bytes) -> None:
    """Remove the segment of a BODY_FILE frame nobody will read (its request is gone)."""
    with contextlib.suppress(ValueError):
        open_segment(directory, payload).close()

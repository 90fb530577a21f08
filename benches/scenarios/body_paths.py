"""What a bulk body costs on each path from a worker's memory to a client's socket, in CPU per
MiB of each process, on loopback: the paths a records GET could take.

    python benches/scenarios/body_paths.py             # 2 GiB per path, each path twice
    python benches/scenarios/body_paths.py --quick     # 256 MiB, once

- `direct`: the sender writes from its memory on the client's socket (`sendmsg`): what a
  worker writing on a lent connection pays (docs/ipc.md, "Lent connections").
- `file`: a writer puts each 4 MiB in a new tmpfs file, another process opens, unlinks and
  `sendfile`s it: the shared-memory segments' path (the worker, then the front).
- `pipe`: a writer writes into a pipe, another process `splice`s it on to the socket.

Each process counts its own CPU (getrusage), the client too (it reads into a reused
buffer). Figures: docs/performance.md, "Records GETs on a lent connection".
"""

from __future__ import annotations

import argparse
import fcntl
import json
import multiprocessing as mp
import os
import resource
import socket
import sys
import time
from multiprocessing.queues import Queue
from typing import Any

SEGMENT = 4 << 20
SLICE = 1 << 20
F_SETPIPE_SZ = 1031  # Linux's fcntl to size a pipe


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _client(ports: Queue[int], results: Queue[tuple[str, float]]) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    ports.put(listener.getsockname()[1])
    conn, _ = listener.accept()
    buffer = bytearray(SLICE)
    start = _cpu()
    while conn.recv_into(buffer):
        pass
    results.put(("client", _cpu() - start))


def _direct(port: int, total: int, results: Queue[tuple[str, float]]) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    data = memoryview(os.urandom(SEGMENT))
    start = _cpu()
    for _ in range(total // SEGMENT):
        for offset in range(0, SEGMENT, SLICE):
            sock.sendall(data[offset : offset + SLICE])
    results.put(("sender", _cpu() - start))
    sock.close()


def _file_writer(total: int, names: Queue[str | None], results: Queue[tuple[str, float]]) -> None:
    data = os.urandom(SEGMENT)
    start = _cpu()
    for index in range(total // SEGMENT):
        path = f"/dev/shm/body-paths-{os.getpid()}-{index}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, data)
        os.close(fd)
        names.put(path)
    names.put(None)
    results.put(("writer", _cpu() - start))


def _file_sender(port: int, names: Queue[str | None], results: Queue[tuple[str, float]]) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    start = _cpu()
    while (path := names.get()) is not None:
        fd = os.open(path, os.O_RDONLY)
        os.unlink(path)
        offset = 0
        while offset < SEGMENT:
            offset += os.sendfile(sock.fileno(), fd, offset, min(SLICE, SEGMENT - offset))
        os.close(fd)
    results.put(("sender", _cpu() - start))
    sock.close()


def _pipe_writer(write: int, read: int, total: int, results: Queue[tuple[str, float]]) -> None:
    os.close(read)
    data = memoryview(os.urandom(SEGMENT))
    start = _cpu()
    for _ in range(total // SEGMENT):
        view = data
        while view:
            view = view[os.write(write, view[:SLICE]) :]
    os.close(write)
    results.put(("writer", _cpu() - start))


def _pipe_sender(port: int, read: int, write: int, results: Queue[tuple[str, float]]) -> None:
    os.close(write)
    sock = socket.create_connection(("127.0.0.1", port))
    start = _cpu()
    while os.splice(read, sock.fileno(), SLICE):
        pass
    results.put(("sender", _cpu() - start))
    sock.close()


def run_path(path: str, total: int) -> dict[str, float]:
    """CPU ms per MiB of each process of `path`, and the wall time per MiB."""
    ctx = mp.get_context("fork")
    ports: Queue[int] = ctx.Queue()
    results: Queue[tuple[str, float]] = ctx.Queue()
    procs = [ctx.Process(target=_client, args=(ports, results))]
    procs[0].start()
    port = ports.get()
    pipe: tuple[int, int] | None = None
    if path == "direct":
        procs.append(ctx.Process(target=_direct, args=(port, total, results)))
    elif path == "file":
        names: Queue[str | None] = ctx.Queue(maxsize=8)
        procs.append(ctx.Process(target=_file_writer, args=(total, names, results)))
        procs.append(ctx.Process(target=_file_sender, args=(port, names, results)))
    else:
        read, write = os.pipe()
        fcntl.fcntl(write, F_SETPIPE_SZ, SLICE)
        pipe = (read, write)
        procs.append(ctx.Process(target=_pipe_writer, args=(write, read, total, results)))
        procs.append(ctx.Process(target=_pipe_sender, args=(port, read, write, results)))
    started = time.perf_counter()
    for proc in procs[1:]:
        proc.start()
    if pipe is not None:
        for fd in pipe:
            os.close(fd)
    cpu = dict(results.get() for _ in procs)
    for proc in procs:
        proc.join()
    mib = total / (1 << 20)
    figures = {
        f"{name}_ms_per_mib": round(1000 * seconds / mib, 3) for name, seconds in cpu.items()
    }
    gateway = sum(seconds for name, seconds in cpu.items() if name != "client")
    figures["gateway_ms_per_mib"] = round(1000 * gateway / mib, 3)
    figures["wall_ms_per_mib"] = round(1000 * (time.perf_counter() - started) / mib, 3)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="256 MiB per path, once")
    args = parser.parse_args()
    total = (256 if args.quick else 2048) << 20
    results: dict[str, Any] = {path: [] for path in ("direct", "file", "pipe")}
    for _ in range(1 if args.quick else 2):
        for path in results:
            results[path].append(run_path(path, total))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

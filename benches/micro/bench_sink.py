"""BytesSink benchmarks: Rust core vs pure-Python twin in one run (docs/performance.md).

A 21 MiB reply body (the base64 R3 of a 16 MiB-R3 turn) received into a sink from a
socketpair in the pieces the kernel hands out, then finished into `bytes`: what the
upstream client does per R3 turn. The Rust sink is the final bytes object (huge-page backed);
the twin receives into a bytearray and copies it at `finish`.

Run with ``pytest benches/micro/bench_sink.py --benchmark-only``; with ``--benchmark-disable`` each
case runs once as a test (results are still checked).
"""

from __future__ import annotations

import socket
import threading

import pytest

from sessiongate.primitives import get_impl

IMPLS = ["rust", "python"]
BODY = bytes(range(256)) * (21 * 4096)  # 21 MiB


def _receive(sink_cls: type, body: bytes) -> bytes:
    left, right = socket.socketpair()
    sender = threading.Thread(target=right.sendall, args=(body,))
    sender.start()
    try:
        sink = sink_cls(len(body))
        view = sink.view()
        received = 0
        while received < len(body):
            received += left.recv_into(view[received:])
        view.release()
        return sink.finish(received)
    finally:
        sender.join()
        left.close()
        right.close()


@pytest.mark.parametrize("impl_name", IMPLS)
def test_receive_21mib_body(benchmark, impl_name):
    benchmark.group = "BytesSink: receive a 21 MiB body from a socket, then finish"
    sink_cls = get_impl(impl_name).BytesSink
    data = benchmark.pedantic(_receive, args=(sink_cls, BODY), rounds=20, warmup_rounds=1)
    assert data == BODY

"""Frame codec benchmarks: Rust core vs pure-Python twin in one run (docs/performance.md).

Run with ``pytest benches/ --benchmark-only``; with ``--benchmark-disable`` each benchmark
runs once as a plain test (results are still checked).
"""

from __future__ import annotations

import os

import pytest

from sessiongate.primitives import get_impl

IMPLS = ["rust", "python"]
PAYLOAD_1K = os.urandom(1024)
N_FRAMES = 10_000
PIECE = 64 * 1024
META = {
    "op": "chat",
    "session_id": "0123456789abcdef0123456789abcdef",
    "path": "/v1/chat/completions",
    "method": "POST",
    "query": "",
    "headers": {"content-type": "application/json", "x-session-id": "abc"},
}
BODIES = {"1MiB": os.urandom(1 << 20), "16MiB": os.urandom(16 << 20)}


@pytest.mark.parametrize("impl_name", IMPLS)
def test_encode_frame(benchmark, impl_name):
    """1,000 encode_frame calls with 1 KiB payloads (looped, like test_shard_index)."""
    benchmark.group = "encode_frame: 1,000 frames of 1 KiB"
    impl = get_impl(impl_name)
    encode_frame, reply = impl.encode_frame, impl.FRAME_REPLY

    def run() -> list[bytes]:
        return [encode_frame(reply, rid, PAYLOAD_1K) for rid in range(1_000)]

    frames = benchmark(run)
    assert frames[7] == get_impl("python").encode_frame(2, 7, PAYLOAD_1K)


def _stream() -> list[bytes]:
    encode = get_impl("python").encode_frame
    wire = b"".join(encode(2, rid, PAYLOAD_1K) for rid in range(N_FRAMES))
    return [wire[i : i + PIECE] for i in range(0, len(wire), PIECE)]


PIECES = _stream()


@pytest.mark.parametrize("impl_name", IMPLS)
def test_decode_stream(benchmark, impl_name):
    """A fresh FrameDecoder fed 10,000 1 KiB frames in 64 KiB pieces."""
    benchmark.group = "FrameDecoder: 10,000 x 1 KiB frames in 64 KiB pieces"
    decoder_cls = get_impl(impl_name).FrameDecoder

    def run() -> int:
        decoder = decoder_cls()
        count = 0
        for piece in PIECES:
            count += len(decoder.feed(piece))
        return count

    assert benchmark(run) == N_FRAMES


@pytest.mark.parametrize("size", list(BODIES))
@pytest.mark.parametrize("impl_name", IMPLS)
def test_encode_envelope(benchmark, impl_name, size):
    """encode_envelope of request meta + one body (dominated by the single body copy)."""
    benchmark.group = "encode_envelope: 1 body"
    encode = get_impl(impl_name).encode_envelope
    body = BODIES[size]
    env = benchmark(encode, META, body)
    assert len(env) > len(body) and env.endswith(body[-64:])


@pytest.mark.parametrize("size", list(BODIES))
@pytest.mark.parametrize("impl_name", IMPLS)
def test_decode_envelope(benchmark, impl_name, size):
    """decode_envelope: parses only the meta; the body is a view, so size must not matter."""
    benchmark.group = "decode_envelope: 1 body (zero-copy)"
    impl = get_impl(impl_name)
    payload = impl.encode_envelope(META, BODIES[size])
    meta, body = benchmark(impl.decode_envelope, payload)
    assert meta == META and body.nbytes == len(BODIES[size]) and body.obj is payload

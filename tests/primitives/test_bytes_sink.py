"""BytesSink: a bytes object received in place (rust/bytes_sink.rs and its Python twin).

Both must give the same bytes for the same writes, the same errors with the same messages,
and a finished sink's bytes must be an ordinary immutable bytes that no view can change.
"""

from __future__ import annotations

import socket
import threading
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessiongate.primitives import get_impl

IMPLS = [get_impl("rust"), get_impl("python")]
IDS = ["rust", "python"]

writes = st.lists(st.tuples(st.integers(0, 5000), st.binary(max_size=300)), max_size=12)


def _write(target: bytearray | memoryview, head: bytes, plan: list[tuple[int, bytes]]) -> int:
    """A received prefix (`head`, as recv_into writes one), then overwrites anywhere; the
    prefix's length, the `filled` that `finish` is given."""
    size = len(target)
    filled = min(len(head), size)
    target[:filled] = head[:filled]
    for offset, data in plan:
        start = min(offset, size)
        chunk = data[: size - start]
        target[start : start + len(chunk)] = chunk
    return filled


def _expected(size: int, head: bytes, plan: list[tuple[int, bytes]]) -> bytes:
    """What a finished sink holds: the writes up to `filled`, zero past it."""
    data = bytearray(size)
    filled = _write(data, head, plan)
    data[filled:] = bytes(size - filled)
    return bytes(data)


def _fill(impl: Any, size: int, head: bytes, plan: list[tuple[int, bytes]]) -> bytes:
    sink = impl.BytesSink(size)
    view = sink.view()
    filled = _write(view, head, plan)
    view.release()
    return sink.finish(filled)


@settings(max_examples=300, deadline=None)
@given(size=st.integers(0, 5000), head=st.binary(max_size=5000), plan=writes)
def test_same_bytes_as_the_twin(size: int, head: bytes, plan: list[tuple[int, bytes]]) -> None:
    expected = _expected(size, head, plan)
    results = [_fill(impl, size, head, plan) for impl in IMPLS]
    assert all(type(r) is bytes for r in results)
    assert results[0] == results[1] == expected


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_no_stale_heap_bytes_past_filled(impl: Any) -> None:
    # Sinks are not zeroed at creation; memory freed by an earlier sink comes back full of
    # its bytes, and whatever the caller did not fill must still read as zero.
    size = 3 << 20
    for filled in (size, 1000, 0):
        sink = impl.BytesSink(size)
        view = sink.view()
        view[:filled] = b"\xab" * filled
        view.release()
        body = sink.finish(filled)
        assert body[:filled] == b"\xab" * filled
        assert body[filled:].count(0) == size - filled
        del body


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_large_sink_is_received_in_place_and_zero_past_filled(impl: Any) -> None:
    size = 9 << 20  # large enough for the huge-page advice in the Rust sink
    payload = bytes(range(256)) * 4096  # 1 MiB
    left, right = socket.socketpair()
    sink = impl.BytesSink(size)
    view = sink.view()
    sender = threading.Thread(target=right.sendall, args=(payload,))
    sender.start()  # the payload is larger than a socket buffer
    try:
        received = 0
        while received < len(payload):
            received += left.recv_into(view[received:])
    finally:
        sender.join(timeout=30)
        left.close()
        right.close()
    view.release()
    body = sink.finish(received)
    assert len(body) == size and body[: len(payload)] == payload
    assert body[len(payload) :].count(0) == size - len(payload)


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_finished_bytes_cannot_change(impl: Any) -> None:
    sink = impl.BytesSink(4)
    view = sink.view()
    view[:] = b"abcd"
    view.release()
    body = sink.finish(4)
    assert hash(body) == hash(b"abcd")
    with pytest.raises(BufferError, match="spent"):
        sink.view()
    assert body == b"abcd"


def _errors(impl: Any) -> list[str]:
    out: list[str] = []
    for size in (-1, "3", 2.5):
        try:
            impl.BytesSink(size)
        except (ValueError, TypeError) as exc:
            out.append(type(exc).__name__ + (f": {exc}" if isinstance(exc, ValueError) else ""))
    sink = impl.BytesSink(3)
    view = sink.view()
    part = view[1:]
    view.release()
    for filled in (-1, 4, "3"):
        try:
            sink.finish(filled)
        except (ValueError, TypeError) as exc:
            out.append(type(exc).__name__ + (f": {exc}" if isinstance(exc, ValueError) else ""))
    try:
        sink.finish(3)  # a slice still holds the buffer
    except BufferError as exc:
        out.append(str(exc))
    part.release()
    out.append(repr(sink))
    out.append(repr(sink.finish(0)))
    out.append(repr(sink))
    try:
        sink.finish(3)
    except BufferError as exc:
        out.append(str(exc))
    out.append(str(len(sink)))
    return out


def test_same_errors_and_states_as_the_twin() -> None:
    rust, python = (_errors(impl) for impl in IMPLS)
    assert rust == python
    assert "ValueError: BytesSink size must be >= 0, not -1" in rust
    assert "BytesSink.finish(filled): filled must be between 0 and 3, not 4" in rust[4]
    assert "views of the sink are still open" in rust[6]

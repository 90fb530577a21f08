"""The records store's entry files: checksummed entries read back whole, every kind of torn
or lying tail detected (never served), and where R3 text lies in a reply."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessiongate.session.store.entry_file import (
    HEADER,
    KIND_OPEN,
    KIND_TURN,
    MAGIC,
    entry_header,
    read_exact,
    scan,
    write_all,
)
from sessiongate.session.store.turn_entry import span_in


def write_entries(path: Path, payloads: list[list[bytes]]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for index, parts in enumerate(payloads):
            kind = KIND_OPEN if index == 0 else KIND_TURN
            write_all(fd, [entry_header(kind, parts), *parts])
    finally:
        os.close(fd)


def scanned(path: Path) -> tuple[list[bytes], int, bool]:
    fd = os.open(path, os.O_RDONLY)
    try:
        found = scan(fd)
        bodies = [read_exact(fd, e.offset, e.length) for e in found.entries]
    finally:
        os.close(fd)
    return bodies, found.valid_end, found.torn


@settings(max_examples=60, deadline=None)
@given(
    payloads=st.lists(st.lists(st.binary(max_size=300), max_size=4), min_size=1, max_size=5),
    cut=st.integers(min_value=1, max_value=400),
)
def test_entries_read_back_and_any_cut_tail_is_detected(
    tmp_path_factory: pytest.TempPathFactory, payloads: list[list[bytes]], cut: int
) -> None:
    path = tmp_path_factory.mktemp("entries") / "s.rec"
    write_entries(path, payloads)
    bodies, valid_end, torn = scanned(path)
    assert bodies == [b"".join(parts) for parts in payloads]
    assert valid_end == path.stat().st_size and not torn
    # Cut the file anywhere inside the last entry: that entry, and only it, is dropped.
    last = HEADER.size + sum(len(p) for p in payloads[-1])
    original = path.stat().st_size
    os.truncate(path, original - min(cut, last))
    bodies, valid_end, torn = scanned(path)
    assert bodies == [b"".join(parts) for parts in payloads[:-1]]
    assert valid_end == original - last
    assert torn == (cut < last)


def test_flipped_byte_lying_length_and_garbage_stop_the_scan(tmp_path: Path) -> None:
    path = tmp_path / "s.rec"
    write_entries(path, [[b'{"open": 1}'], [b"turn one"], [b"turn two"]])
    size = path.stat().st_size
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # the last payload's checksum no longer matches
    path.write_bytes(bytes(data))
    bodies, valid_end, torn = scanned(path)
    assert bodies == [b'{"open": 1}', b"turn one"] and torn
    assert valid_end == size - HEADER.size - len(b"turn two")
    # A header claiming a petabyte of payload is not believed (nor allocated).
    path.write_bytes(bytes(data[:valid_end]) + struct.pack("<4sB3xQI", MAGIC, 2, 1 << 50, 0))
    assert scanned(path)[0] == [b'{"open": 1}', b"turn one"]
    path.write_bytes(bytes(data[:valid_end]) + b"not an entry at all")
    assert scanned(path)[1] == valid_end


def test_span_in_finds_the_key_not_its_decoys() -> None:
    text = b"QUJD" * 40
    body = (
        b'{"content":"\\"routed_experts\\":\\"QUJD\\"","meta_info":{"routed_experts": "'
        + text
        + b'","x":1}}'
    )
    view = memoryview(body)[body.index(text) : body.index(text) + len(text)]
    start, end = span_in(body, view, b"routed_experts") or (0, 0)
    assert body[start:end] == text and start == body.index(text)
    assert span_in(body, None, b"routed_experts") is None
    assert span_in(body, memoryview(b"QUJE" * 40), b"routed_experts") is None

"""Checksummed, length-prefixed entries appended to a file, and the scan that reads them back.

An entry is a 20-byte header (magic, kind, payload length, CRC-32 of the payload) and its
payload. A crash mid-append leaves a torn last entry (short header, short payload or a
checksum that does not match): the scan stops there and reports the valid length, so
recovery can cut the tail off and never serve it. CRC-32 (zlib, GIL released) rather than
blake2b: it detects torn and corrupted writes, which is its only job here, at ~5x the speed
(64 MiB: 20 ms vs 97 ms on the 2-core dev VM).
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

MAGIC = b"SGRE"
HEADER = struct.Struct("<4sB3xQI")  # magic, kind, payload length, crc32(payload)
KIND_OPEN = 1
KIND_TURN = 2
KINDS = (KIND_OPEN, KIND_TURN)
# Payloads over this are not believed (a lying length must not make the scan allocate it).
MAX_PAYLOAD = 1 << 40
_READ_CHUNK = 8 << 20

Buffer = bytes | bytearray | memoryview


def entry_header(kind: int, parts: Sequence[Buffer]) -> bytes:
    """The header of an entry whose payload is `parts` concatenated."""
    crc = 0
    length = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
        length += len(part)
    return HEADER.pack(MAGIC, kind, length, crc)


def write_all(fd: int, parts: Sequence[Buffer]) -> int:
    """Write every part (os.write may write less than asked); returns the bytes written."""
    total = 0
    for part in parts:
        view = memoryview(part).cast("B")
        while view:
            written = os.write(fd, view)
            total += written
            view = view[written:]
    return total


@dataclass(frozen=True)
class Entry:
    kind: int
    offset: int  # of the payload in the file
    length: int


@dataclass
class Scan:
    entries: list[Entry]
    valid_end: int  # bytes of whole, checksummed entries from the start of the file
    size: int
    problem: str | None = None  # why the scan stopped before `size`, if it did

    @property
    def torn(self) -> bool:
        return self.valid_end < self.size


def scan(fd: int) -> Scan:
    """Every whole entry of the file open at `fd`, checksums verified, in file order."""
    size = os.fstat(fd).st_size
    entries: list[Entry] = []
    offset = 0
    while offset < size:
        head = os.pread(fd, HEADER.size, offset)
        if len(head) < HEADER.size:
            return Scan(entries, offset, size, f"short entry header at byte {offset}")
        magic, kind, length, crc = HEADER.unpack(head)
        if magic != MAGIC or kind not in KINDS:
            return Scan(entries, offset, size, f"no entry header at byte {offset}")
        start = offset + HEADER.size
        if length > MAX_PAYLOAD or start + length > size:
            return Scan(entries, offset, size, f"entry at byte {offset} is cut short")
        if _crc(fd, start, length) != crc:
            return Scan(entries, offset, size, f"entry at byte {offset} fails its checksum")
        entries.append(Entry(kind, start, length))
        offset = start + length
    return Scan(entries, offset, size)


def _crc(fd: int, start: int, length: int) -> int:
    # One reused buffer: recovery reads every byte once, and fresh 8 MiB bytes objects
    # cost as much as the reads themselves.
    buffer = memoryview(bytearray(min(length, _READ_CHUNK) or 1))
    crc = 0
    end = start + length
    while start < end:
        got = os.preadv(fd, [buffer[: min(len(buffer), end - start)]], start)
        if got <= 0:
            raise EOFError(f"file ends at byte {start}, before {end}")
        crc = zlib.crc32(buffer[:got], crc)
        start += got
    return crc


def read_range(fd: int, start: int, length: int, chunk: int = _READ_CHUNK) -> Iterator[bytes]:
    """`length` bytes from `start` in chunks (EOFError if the file is shorter)."""
    end = start + length
    while start < end:
        piece = os.pread(fd, min(chunk, end - start), start)
        if not piece:
            raise EOFError(f"file ends at byte {start}, before {end}")
        yield piece
        start += len(piece)


def read_exact(fd: int, start: int, length: int) -> bytes:
    data = os.pread(fd, length, start)
    if len(data) == length:
        return data
    return b"".join(read_range(fd, start, length))

"""A turn record whose request and response bytes live only in its session's file.

It answers like a TurnRecord (same fields; `request`, `response`, `routed_experts` and
`indexer_topk` are read from the file when asked for), and a records GET streams its
bodies from the file in chunks off the event loop, so a session of many GiB is never
loaded whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, fields
from typing import Any

from sessiongate.session.state import TurnRecord
from sessiongate.session.store.entry_file import read_exact, read_range

_BODIES = ("request", "response", "routed_experts", "indexer_topk")
CHUNK = 1 << 20


@dataclass(frozen=True)
class BodyLocation:
    path: str
    request_offset: int
    request_len: int
    response_offset: int
    response_len: int
    routed_span: tuple[int, int] | None  # in the response
    indexer_span: tuple[int, int] | None


class SpilledRecord(TurnRecord):
    """Built by `spill()`, never by TurnRecord's constructor (its bodies are properties)."""

    location: BodyLocation

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("use spill(record, location)")

    # dataclass fields named like these hold the in-memory bodies; here they are read back.
    @property  # type: ignore[override]
    def request(self) -> bytes:
        return self._read(self.location.request_offset, self.location.request_len)

    @property  # type: ignore[override]
    def response(self) -> bytes:
        return self._read(self.location.response_offset, self.location.response_len)

    @property  # type: ignore[override]
    def routed_experts(self) -> memoryview | None:
        return self._read_span(self.location.routed_span)

    @property  # type: ignore[override]
    def indexer_topk(self) -> memoryview | None:
        return self._read_span(self.location.indexer_span)

    @property
    def size(self) -> int:
        return self.location.request_len + self.location.response_len

    def json_parts(self) -> Iterator[bytes]:  # type: ignore[override]
        """The record's JSON (blocking reads; `json_chunks` is the event loop's way)."""
        head = self.json_head()
        yield head
        with _opened(self.location.path) as fd:
            yield from read_range(fd, self.location.request_offset, self.location.request_len)
            yield b',"response":'
            yield from read_range(fd, self.location.response_offset, self.location.response_len)
        yield b"}"

    async def json_chunks(self) -> AsyncIterator[bytes]:
        """The record's JSON in chunks of at most 1 MiB, each read off the event loop."""
        yield self.json_head()
        with _opened(self.location.path) as fd:
            for label, offset, length in (
                (b"", self.location.request_offset, self.location.request_len),
                (b',"response":', self.location.response_offset, self.location.response_len),
            ):
                if label:
                    yield label
                end = offset + length
                while offset < end:
                    size = min(CHUNK, end - offset)
                    piece = await asyncio.to_thread(read_exact, fd, offset, size)
                    yield piece
                    offset += size
        yield b"}"

    def _read(self, offset: int, length: int) -> bytes:
        with _opened(self.location.path) as fd:
            return read_exact(fd, offset, length)

    def _read_span(self, span: tuple[int, int] | None) -> memoryview | None:
        if span is None:
            return None
        start = self.location.response_offset + span[0]
        return memoryview(self._read(start, span[1] - span[0]))

    def __repr__(self) -> str:
        return f"SpilledRecord({self.location.path!r}, {self.size} bytes)"

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)


def spill(record: TurnRecord, location: BodyLocation) -> SpilledRecord:
    """The same record with its bodies left to the file."""
    spilled = object.__new__(SpilledRecord)
    for item in fields(TurnRecord):
        if item.name not in _BODIES:
            object.__setattr__(spilled, item.name, getattr(record, item.name))
    object.__setattr__(spilled, "location", location)
    return spilled


@contextlib.contextmanager
def _opened(path: str) -> Iterator[int]:
    fd = os.open(path, os.O_RDONLY)
    try:
        yield fd
    finally:
        os.close(fd)

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

from sessiongate.errors import RecordsFileError
from sessiongate.session.state import TurnRecord
from sessiongate.session.store.entry_file import read_exact, read_range

_BODIES = ("request", "response", "routed_experts", "indexer_topk")
CHUNK = 1 << 20


class OpenFile:
    """One read-only descriptor of a session's file, closed when the last record read
    through it is gone: a GET that started keeps reading even if a DELETE unlinks it."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise RecordsFileError(f"records file {path} cannot be opened: {exc}") from exc

    def __del__(self) -> None:
        fd = getattr(self, "fd", None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


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
    file: OpenFile | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("use spill(record, location)")

    # dataclass fields named like these hold the in-memory bodies; here they are read back.
    @property
    def request(self) -> bytes:
        return self._read(self.location.request_offset, self.location.request_len)

    @property
    def response(self) -> bytes:
        return self._read(self.location.response_offset, self.location.response_len)

    @property
    def routed_experts(self) -> memoryview | None:
        return self._read_span(self.location.routed_span)

    @property
    def indexer_topk(self) -> memoryview | None:
        return self._read_span(self.location.indexer_span)

    @property
    def size(self) -> int:
        return self.location.request_len + self.location.response_len

    def json_parts(self) -> Iterator[bytes]:
        """The record's JSON (blocking reads; `json_chunks` is the event loop's way)."""
        head = self.json_head()
        yield head
        with self._opened() as fd:
            yield from read_range(fd, self.location.request_offset, self.location.request_len)
            yield b',"response":'
            yield from read_range(fd, self.location.response_offset, self.location.response_len)
        yield b"}"

    async def json_chunks(self) -> AsyncIterator[bytes]:
        """The record's JSON in chunks of at most 1 MiB, each read off the event loop."""
        yield self.json_head()
        with self._opened() as fd:
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
        with self._opened() as fd:
            try:
                return read_exact(fd, offset, length)
            except (OSError, EOFError) as exc:
                raise RecordsFileError(f"records file {self.location.path}: {exc}") from exc

    def pinned(self, file: OpenFile) -> SpilledRecord:
        """This record, read through `file` (see pin_files)."""
        copy = object.__new__(SpilledRecord)
        copy.__dict__.update(self.__dict__)
        object.__setattr__(copy, "file", file)
        return copy

    @contextlib.contextmanager
    def _opened(self) -> Iterator[int]:
        if self.file is not None:
            yield self.file.fd
            return
        opened = OpenFile(self.location.path)
        yield opened.fd
        del opened

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
    object.__setattr__(spilled, "file", None)
    return spilled


def pin_files(records: list[TurnRecord]) -> list[TurnRecord]:
    """The records, with each spilled one reading through one descriptor of its file opened
    now. Called under the session's lock, so a DELETE that comes later cannot pull the file
    away from a GET, trajectory export or /samples already under way."""
    files: dict[str, OpenFile] = {}
    pinned: list[TurnRecord] = []
    for record in records:
        if isinstance(record, SpilledRecord):
            path = record.location.path
            file = files.get(path)
            if file is None:
                file = files[path] = OpenFile(path)
            record = record.pinned(file)
        pinned.append(record)
    return pinned

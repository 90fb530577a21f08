"""Pure-Python twin of ``rust/bytes_sink.rs``: a bytes object filled in place, then handed out.

The twin fills a ``bytearray`` and copies it into ``bytes`` at ``finish``: same results and
errors as the Rust sink, one copy more (Python code cannot write into a ``bytes``).
"""

from __future__ import annotations

import operator

_SPENT = "BytesSink.finish(filled) was already called: the sink is spent"
_OPEN_VIEWS = "BytesSink.finish(filled): views of the sink are still open; release them first"


class BytesSink:
    """A ``bytes`` of ``size`` bytes, writable through ``view()`` until ``finish(filled)``,
    which zeroes whatever lies past the ``filled`` bytes the caller wrote."""

    __slots__ = ("_data", "_size")

    def __init__(self, size: int) -> None:
        size = operator.index(size)
        if size < 0:
            raise ValueError(f"BytesSink size must be >= 0, not {size}")
        self._size = size
        self._data: bytearray | None = bytearray(size)

    def view(self) -> memoryview:
        """A writable memoryview of the whole sink (release it before ``finish``)."""
        if self._data is None:
            raise BufferError(_SPENT)
        return memoryview(self._data)

    def finish(self, filled: int) -> bytes:
        """The ``bytes``, its first ``filled`` bytes as written through views and the rest
        zero; the sink is spent afterwards."""
        if self._data is None:
            raise BufferError(_SPENT)
        filled = operator.index(filled)
        if not 0 <= filled <= self._size:
            raise ValueError(
                f"BytesSink.finish(filled): filled must be between 0 and {self._size}, not {filled}"
            )
        data = bytes(self._data[:filled]) + bytes(self._size - filled)
        try:
            self._data.clear()  # a resize: it fails while any view is exported
        except BufferError:
            raise BufferError(_OPEN_VIEWS) from None
        self._data = None
        return data

    def __len__(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return f"BytesSink(size={self._size}, {'open' if self._data is not None else 'spent'})"

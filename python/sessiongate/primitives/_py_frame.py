"""Pure-Python twin of the Rust IPC frame codec (``rust/frame.rs``).

Layout (docs/architecture.md "Wire contracts", docs/ipc.md)::

    frame    = u64 BE length (9 + len(payload)) | u64 BE request_id | u8 type | payload
    envelope = u64 BE meta_len | compact JSON meta | raw body

Results, exception classes and messages match the Rust implementation. The exception
classes come from :mod:`sessiongate.primitives.errors`, shared with the Rust core.
"""

from __future__ import annotations

import json
import operator
import struct
from typing import Any

from ._py_bytes import byte_view as _byte_view
from .errors import FrameCorrupt, FrameError, FrameTooLarge

__all__ = [
    "DEFAULT_MAX_FRAME",
    "FRAME_ERROR",
    "FRAME_HEADER_SIZE",
    "FRAME_REPLY",
    "FRAME_REQUEST",
    "FrameDecoder",
    "decode_envelope",
    "encode_envelope",
    "encode_frame",
    "encode_frame_header",
]

FRAME_REQUEST = 1
FRAME_REPLY = 2
FRAME_ERROR = 3
FRAME_HEADER_SIZE = 17  # u64 length + u64 request id + u8 type
DEFAULT_MAX_FRAME = 64 * 2**30

_LENGTH_OVERHEAD = 9  # the length field counts request id + type + payload
_U64_MAX = 2**64 - 1
_HEADER = struct.Struct(">QQB")
_U64 = struct.Struct(">Q")
_JSON_ENCODE = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
_JSON_DECODE = json.JSONDecoder().decode
_BytesLike = bytes | bytearray | memoryview


def _u64_arg(value: object, func: str, arg: str, lo: int = 0, hi: int = _U64_MAX) -> int:
    try:
        v = operator.index(value)  # type: ignore[arg-type]  # any object: a TypeError is the answer
    except TypeError:
        raise TypeError(
            f"{func}() argument '{arg}' must be int, not {type(value).__name__}"
        ) from None
    if not lo <= v <= hi:
        raise ValueError(f"{func}() argument '{arg}' must be in {lo}..{hi}, got {v}")
    return v


def _max_frame_arg(value: object, func: str) -> int:
    if value is None:
        return DEFAULT_MAX_FRAME
    try:
        v = operator.index(value)  # type: ignore[arg-type]  # any object: a TypeError is the answer
    except TypeError:
        raise TypeError(
            f"{func}() argument 'max_frame' must be int, not {type(value).__name__}"
        ) from None
    if v < _LENGTH_OVERHEAD:
        raise ValueError(f"{func}() argument 'max_frame' must be >= 9, got {v}")
    # The length field is a u64, so a larger cap means "no cap".
    return min(v, _U64_MAX)


def _too_large(payload_len: int, limit: int) -> FrameTooLarge:
    return FrameTooLarge(
        f"frame length {_LENGTH_OVERHEAD + payload_len} (9 + {payload_len}-byte payload) "
        f"exceeds max_frame {limit}"
    )


def encode_frame_header(
    frame_type: int,
    request_id: int,
    payload_len: int,
    *,
    max_frame: int | None = DEFAULT_MAX_FRAME,
) -> bytes:
    """The 17 header bytes of a frame whose payload is written separately (vectored write)."""
    ftype = _u64_arg(frame_type, "encode_frame_header", "frame_type", 0, 255)
    rid = _u64_arg(request_id, "encode_frame_header", "request_id")
    plen = _u64_arg(payload_len, "encode_frame_header", "payload_len")
    limit = _max_frame_arg(max_frame, "encode_frame_header")
    if plen > limit - _LENGTH_OVERHEAD:
        raise _too_large(plen, limit)
    return _HEADER.pack(plen + _LENGTH_OVERHEAD, rid, ftype)


def encode_frame(
    frame_type: int,
    request_id: int,
    payload: _BytesLike,
    *,
    max_frame: int | None = DEFAULT_MAX_FRAME,
) -> bytes:
    """One whole frame as bytes (the payload is copied exactly once)."""
    ftype = _u64_arg(frame_type, "encode_frame", "frame_type", 0, 255)
    rid = _u64_arg(request_id, "encode_frame", "request_id")
    if type(payload) is bytes:
        plen = len(payload)
        body: _BytesLike = payload
    else:
        body = _byte_view(payload, "encode_frame", "payload")
        plen = body.nbytes
    # The default is the common case: skip the argument checks for it.
    limit = (
        DEFAULT_MAX_FRAME
        if max_frame is DEFAULT_MAX_FRAME
        else _max_frame_arg(max_frame, "encode_frame")
    )
    if plen > limit - _LENGTH_OVERHEAD:
        raise _too_large(plen, limit)
    return b"".join((_HEADER.pack(plen + _LENGTH_OVERHEAD, rid, ftype), body))


class FrameDecoder:
    """Incremental frame decoder: ``feed`` bytes as they arrive, get back whole frames.

    Any split of the stream is accepted. A header whose length is below 9 (FrameCorrupt) or
    above ``max_frame`` (FrameTooLarge) is reported as soon as its 8 length bytes have
    arrived; after that the decoder is closed and every ``feed`` raises FrameError, because a
    stream that lost its framing cannot be trusted again. Frames completed earlier in the
    same ``feed`` call are discarded with it (the channel is torn down anyway).
    """

    __slots__ = ("_chunks", "_error", "_ftype", "_head", "_left", "_max_frame", "_offset", "_rid")

    def __init__(self, max_frame: int | None = DEFAULT_MAX_FRAME) -> None:
        self._max_frame = _max_frame_arg(max_frame, "FrameDecoder")
        self._head = bytearray()  # partial header (< 17 bytes) while not inside a payload
        self._chunks: list[bytes] = []  # payload pieces of the frame in progress
        self._left = 0  # payload bytes still missing; > 0 only inside a payload
        self._ftype = 0
        self._rid = 0
        self._offset = 0  # stream offset of the frame in progress (for error messages)
        self._error: str | None = None

    @property
    def max_frame(self) -> int:
        """The largest accepted length field (9 + payload length)."""
        return self._max_frame

    @property
    def buffered(self) -> int:
        """Bytes of the incomplete frame held by the decoder (header + payload so far)."""
        if self._left:
            return FRAME_HEADER_SIZE + sum(len(c) for c in self._chunks)
        return len(self._head)

    @property
    def pending_frame_size(self) -> int | None:
        """Wire size (8 + length) of the incomplete frame once its length is known."""
        if self._left:
            return FRAME_HEADER_SIZE + sum(len(c) for c in self._chunks) + self._left
        if len(self._head) >= 8:
            return 8 + _U64.unpack_from(self._head)[0]
        return None

    @property
    def closed(self) -> bool:
        """True after a decode error: every later ``feed`` raises FrameError."""
        return self._error is not None

    def _check_length(self, length: int) -> None:
        if length < _LENGTH_OVERHEAD:
            self._fail(
                FrameCorrupt,
                f"corrupt frame at stream offset {self._offset}: length field {length} "
                "is below the 9-byte minimum",
            )
        if length > self._max_frame:
            self._fail(
                FrameTooLarge,
                f"frame at stream offset {self._offset} has length {length} "
                f"(9 + {length - _LENGTH_OVERHEAD}-byte payload), above max_frame "
                f"{self._max_frame}",
            )

    def _fail(self, cls: type[FrameError], message: str) -> None:
        self._error = message
        self._head = bytearray()
        self._chunks = []
        self._left = 0
        raise cls(message)

    def feed(self, data: _BytesLike) -> list[tuple[int, int, bytes]]:
        """Consume ``data``; return ``(type, request_id, payload)`` for each completed frame."""
        if self._error is not None:
            raise FrameError(f"FrameDecoder is closed after an earlier error: {self._error}")
        # Slicing a bytes object copies once; a memoryview slice would need a second object.
        src: bytes | memoryview = data if type(data) is bytes else _byte_view(data, "feed", "data")
        end = len(src)
        pos = 0
        out: list[tuple[int, int, bytes]] = []
        if self._left:
            pos = self._fill_payload(src, 0, out)
            if self._left:
                return out
        elif self._head:
            pos = self._fill_head(src, out)
            if pos < 0:
                return out
        unpack = _HEADER.unpack_from
        append = out.append
        max_frame = self._max_frame
        while end - pos >= FRAME_HEADER_SIZE:
            length, rid, ftype = unpack(src, pos)
            if length < _LENGTH_OVERHEAD or length > max_frame:
                self._check_length(length)
            start = pos + FRAME_HEADER_SIZE
            stop = start + length - _LENGTH_OVERHEAD
            if stop > end:
                self._ftype, self._rid = ftype, rid
                self._left = stop - start
                self._fill_payload(src, start, out)
                return out
            append((ftype, rid, bytes(src[start:stop])))
            self._offset += 8 + length
            pos = stop
        if pos < end:
            self._head = bytearray(src[pos:])
            if end - pos >= 8:
                self._check_length(_U64.unpack_from(self._head)[0])
        return out

    def _fill_head(self, src: bytes | memoryview, out: list[tuple[int, int, bytes]]) -> int:
        """Complete a partial header; return where the payload starts in src, or -1."""
        head = self._head
        had = len(head)
        take = min(FRAME_HEADER_SIZE - had, len(src))
        head += src[:take]
        if had < 8 <= len(head):
            self._check_length(_U64.unpack_from(head)[0])
        if len(head) < FRAME_HEADER_SIZE:
            return -1
        length, self._rid, self._ftype = _HEADER.unpack_from(head)
        self._head = bytearray()
        self._left = length - _LENGTH_OVERHEAD
        if self._left == 0:
            self._emit(b"", out)
            return take
        pos = self._fill_payload(src, take, out)
        return pos if self._left == 0 else -1

    def _fill_payload(
        self, src: bytes | memoryview, pos: int, out: list[tuple[int, int, bytes]]
    ) -> int:
        """Append payload bytes from src[pos:]; emit the frame when complete."""
        take = min(self._left, len(src) - pos)
        if take:
            self._chunks.append(bytes(src[pos : pos + take]))
            self._left -= take
        if self._left == 0:
            chunks = self._chunks
            self._chunks = []
            self._emit(chunks[0] if len(chunks) == 1 else b"".join(chunks), out)
        return pos + take

    def _emit(self, payload: bytes, out: list[tuple[int, int, bytes]]) -> None:
        out.append((self._ftype, self._rid, payload))
        self._offset += FRAME_HEADER_SIZE + len(payload)


def encode_envelope(meta: dict[str, Any], body: _BytesLike | None = b"") -> bytes:
    """``u64 BE meta_len | compact JSON meta | body`` (the body is copied exactly once).

    ``body=None`` is the same as an empty body.
    """
    if not isinstance(meta, dict):
        raise TypeError(
            f"encode_envelope() argument 'meta' must be dict, not {type(meta).__name__}"
        )
    if body is None:
        body = b""
    elif type(body) is not bytes:
        body = _byte_view(body, "encode_envelope", "body")
    text = _JSON_ENCODE(meta).encode()
    return b"".join((_U64.pack(len(text)), text, body))


_JSON_KIND = {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}


def decode_envelope(payload: _BytesLike) -> tuple[dict[str, Any], memoryview]:
    """Split an envelope into its meta dict and a zero-copy memoryview of the body."""
    view = _byte_view(payload, "decode_envelope", "payload")
    size = len(view)
    if size < 8:
        raise FrameError(f"envelope truncated at offset 0: need 8 bytes for meta_len, got {size}")
    meta_len = _U64.unpack_from(view)[0]
    if meta_len > size - 8:
        raise FrameError(
            f"envelope truncated at offset 8: meta_len {meta_len} runs past the end of the "
            f"{size}-byte payload"
        )
    end = 8 + meta_len
    try:
        text = str(view[8:end], "utf-8")
    except UnicodeDecodeError as exc:
        raise FrameError(
            f"envelope meta at offset {8 + exc.start} is not valid UTF-8: {exc.reason}"
        ) from None
    try:
        meta = _JSON_DECODE(text)
    except json.JSONDecodeError as exc:
        offset = 8 + len(text[: exc.pos].encode("utf-8", "surrogatepass"))
        raise FrameError(f"envelope meta at offset {offset} is not valid JSON: {exc.msg}") from None
    except (ValueError, RecursionError) as exc:
        # int() digit limit, or nesting deeper than the interpreter's recursion limit.
        raise FrameError(f"envelope meta at offset 8 is not valid JSON: {exc}") from None
    if type(meta) is not dict:
        kind = "null" if meta is None else _JSON_KIND[type(meta)]
        raise FrameError(f"envelope meta at offset 8 must be a JSON object, got {kind}")
    return meta, view[end:]

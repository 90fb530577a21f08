"""The safetensors container, written and read without numpy or torch.

Layout (https://huggingface.co/docs/safetensors): u64 little-endian header length, a JSON
header `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`
padded with spaces to a multiple of 8, then the tensors' little-endian bytes back to back.
Written by hand because it is this small, and so a trainer needs nothing but the file: any
safetensors reader (`safetensors.numpy.load`, `safetensors.torch.load`) opens it.

Tensors are laid out the way the reference writer (`safetensors.numpy.save`) lays them out:
by dtype, widest first (its `Dtype` enum order, descending), then by name. With the header
padded to 8 bytes that keeps every tensor aligned to its item size (zero-copy readers need
it), and the same tensors give the same bytes as the reference writer.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

ITEM_SIZE = {"I32": 4, "F32": 4, "U8": 1, "I64": 8, "F64": 8}
# Rank of each dtype in the reference implementation's `Dtype` enum; data goes out highest first.
_DTYPE_RANK = {"U8": 0, "I32": 1, "F32": 2, "F64": 3, "I64": 4}
_HEADER_LEN = struct.Struct("<Q")
# Refuse absurd headers before allocating them (a corrupt or hostile file).
MAX_HEADER_BYTES = 100 * 1024 * 1024


class SafetensorsError(ValueError):
    pass


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes | bytearray | memoryview | array[Any]  # any C-contiguous buffer


def encode(
    tensors: Sequence[Tensor], metadata: dict[str, str] | None = None
) -> list[bytes | memoryview]:
    """The file as parts (header, then each tensor's bytes uncopied), to join or stream."""
    if sys.byteorder != "little":
        raise SafetensorsError("writing safetensors needs a little-endian machine")
    for tensor in tensors:
        if tensor.dtype not in ITEM_SIZE:
            raise SafetensorsError(f"unsupported dtype {tensor.dtype!r} for {tensor.name!r}")
    if len({t.name for t in tensors}) != len(tensors):
        raise SafetensorsError("tensor names must be unique")
    # Python's str order is code point order, which is the byte order of UTF-8 (Rust's).
    ordered = sorted(tensors, key=lambda t: (-_DTYPE_RANK[t.dtype], t.name))
    header: dict[str, object] = {}
    if metadata:
        # First, as the reference writer puts it (its own key order is a hash map's).
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for tensor in ordered:
        expected = math.prod(tensor.shape) * ITEM_SIZE[tensor.dtype]
        size = memoryview(tensor.data).nbytes
        if size != expected:
            raise SafetensorsError(
                f"tensor {tensor.name!r}: {size} bytes do not fit shape {list(tensor.shape)} "
                f"of {tensor.dtype}"
            )
        header[tensor.name] = {
            "dtype": tensor.dtype,
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    parts: list[bytes | memoryview] = [_HEADER_LEN.pack(len(text)) + text]
    parts += [memoryview(t.data).cast("B") for t in ordered]
    return parts


def encode_bytes(tensors: Sequence[Tensor], metadata: dict[str, str] | None = None) -> bytes:
    return b"".join(encode(tensors, metadata))


def decode(data: bytes | memoryview) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Tensors (zero-copy views into `data`) and the metadata of a safetensors file."""
    view = memoryview(data).cast("B")
    if len(view) < 8:
        raise SafetensorsError("file too short for a safetensors header")
    (header_len,) = _HEADER_LEN.unpack(view[:8])
    if header_len > MAX_HEADER_BYTES or 8 + header_len > len(view):
        raise SafetensorsError(f"header length {header_len} does not fit the file")
    try:
        header = json.loads(bytes(view[8 : 8 + header_len]))
    except ValueError as exc:
        raise SafetensorsError(f"header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise SafetensorsError("header is not a JSON object")
    metadata = header.pop("__metadata__", {}) or {}
    body = view[8 + header_len :]
    tensors: dict[str, Tensor] = {}
    for name, info in header.items():
        try:
            dtype, shape = info["dtype"], tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise SafetensorsError(f"bad header entry for {name!r}: {exc}") from exc
        if dtype not in ITEM_SIZE or not 0 <= begin <= end <= len(body):
            raise SafetensorsError(f"bad dtype or offsets for {name!r}")
        if end - begin != math.prod(shape) * ITEM_SIZE[dtype]:
            raise SafetensorsError(f"offsets of {name!r} do not match its shape")
        tensors[name] = Tensor(name, dtype, shape, body[begin:end])
    return tensors, metadata


def typed(tensor: Tensor) -> memoryview[Any]:  # ints or floats, by dtype
    """A flat typed view of a tensor's data (int32 'i', float32 'f', uint8 'B', ...)."""
    codes: dict[str, Literal["i", "f", "B", "q", "d"]]
    codes = {"I32": "i", "F32": "f", "U8": "B", "I64": "q", "F64": "d"}
    code = codes[tensor.dtype]
    return memoryview(tensor.data).cast("B").cast(code)

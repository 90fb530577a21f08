"""formats/safetensors.py against the reference implementation (the `safetensors` package,
test extra): the same tensors give the same bytes as `safetensors.numpy.save`, the reference
reader opens what we write and we read what it writes, and a corrupt or hostile file is a
`SafetensorsError`, never another exception."""

from __future__ import annotations

from array import array

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from safetensors.numpy import load as reference_load
from safetensors.numpy import save as reference_save

from sessiongate.formats.safetensors import (
    ITEM_SIZE,
    SafetensorsError,
    Tensor,
    decode,
    encode_bytes,
    typed,
)

NUMPY = {"I32": np.int32, "F32": np.float32, "U8": np.uint8, "I64": np.int64, "F64": np.float64}
CODES = {"I32": "i", "F32": "f", "U8": "B", "I64": "q", "F64": "d"}


@st.composite
def tensors(draw: st.DrawFn) -> list[Tensor]:
    names = draw(st.lists(st.text(min_size=1, max_size=8), max_size=5, unique=True))
    out = []
    for name in names:
        dtype = draw(st.sampled_from(sorted(ITEM_SIZE)))
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
        count = int(np.prod(shape)) if shape else 1
        if dtype in ("F32", "F64"):
            values = draw(
                st.lists(st.floats(width=32, allow_nan=False), min_size=count, max_size=count)
            )
        else:
            bits = ITEM_SIZE[dtype] * 8
            low, high = (0, 255) if dtype == "U8" else (-(1 << (bits - 1)), (1 << (bits - 1)) - 1)
            values = draw(st.lists(st.integers(low, high), min_size=count, max_size=count))
        out.append(Tensor(name, dtype, shape, array(CODES[dtype], values)))
    return out


def as_numpy(tensor: Tensor) -> np.ndarray:
    return np.frombuffer(bytes(memoryview(tensor.data).cast("B")), NUMPY[tensor.dtype]).reshape(
        tensor.shape
    )


@given(tensors(), st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2))
def test_the_same_bytes_as_the_reference_writer(
    items: list[Tensor], metadata: dict[str, str]
) -> None:
    ours = encode_bytes(items, metadata or None)
    reference = reference_save({t.name: as_numpy(t) for t in items}, metadata=metadata or None)
    if len(metadata) <= 1:  # the reference orders several metadata keys as a hash map does
        assert ours == reference
    loaded = reference_load(ours)
    assert set(loaded) == {t.name for t in items}
    for tensor in items:
        assert np.array_equal(loaded[tensor.name], as_numpy(tensor))


@given(tensors())
def test_we_read_what_the_reference_writes(items: list[Tensor]) -> None:
    data = reference_save({t.name: as_numpy(t) for t in items}, metadata={"k": "v"})
    found, metadata = decode(data)
    assert metadata == {"k": "v"}
    for tensor in items:
        assert found[tensor.name].shape == tensor.shape
        assert list(typed(found[tensor.name])) == list(
            memoryview(tensor.data).cast("B").cast(CODES[tensor.dtype])
        )


def framed(header: bytes, body: bytes = b"") -> bytes:
    return len(header).to_bytes(8, "little") + header + body


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x01", "too short"),
        ((10**12).to_bytes(8, "little") + b"{}", "does not fit"),
        ((2).to_bytes(8, "little") + b"[]", "not a JSON object"),
        ((3).to_bytes(8, "little") + b"{x}", "not JSON"),
        ((24).to_bytes(8, "little") + b'{"t":{"dtype":"I32"}}   ', "bad header entry"),
        (
            framed(b'{"t":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]}}', b"\0\0"),
            "bad dtype or offsets",
        ),
        (
            framed(b'{"t":{"dtype":"I32","shape":[1],"data_offsets":[0,8]}}', b"\0" * 4),
            "bad dtype or offsets",
        ),
        (
            framed(b'{"t":{"dtype":"I32","shape":[2],"data_offsets":[0,4]}}', b"\0" * 4),
            "do not match its shape",
        ),
    ],
)
def test_a_corrupt_file_is_a_clear_error(data: bytes, message: str) -> None:
    with pytest.raises(SafetensorsError, match=message):
        decode(data)


@given(st.binary(max_size=64))
def test_random_bytes_never_raise_anything_else(data: bytes) -> None:
    try:
        decode(data)
    except SafetensorsError:
        pass


def test_writing_refuses_what_it_cannot_write() -> None:
    with pytest.raises(SafetensorsError, match="unsupported dtype"):
        encode_bytes([Tensor("t", "BF16", (1,), b"\0\0")])
    with pytest.raises(SafetensorsError, match="unique"):
        encode_bytes([Tensor("t", "U8", (1,), b"\0"), Tensor("t", "U8", (1,), b"\0")])
    with pytest.raises(SafetensorsError, match="do not fit shape"):
        encode_bytes([Tensor("t", "I32", (2,), b"\0\0\0\0")])

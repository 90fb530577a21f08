"""IPC frame codec and envelope: layout, Rust == Python twin, error and poisoning parity."""

from __future__ import annotations

import array
import json
import math
import struct
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessiongate.primitives import errors, get_impl
from sessiongate.primitives.errors import FrameCorrupt, FrameError, FrameTooLarge

RUST = get_impl("rust")
PY = get_impl("python")
BOTH = (RUST, PY)
U64_MAX = 2**64 - 1


@pytest.fixture(params=["rust", "python"])
def impl(request: pytest.FixtureRequest) -> SimpleNamespace:
    return get_impl(request.param)


def frame(ftype: int, rid: int, payload: bytes) -> bytes:
    """The layout of docs/architecture.md ("Wire contracts"), written out independently of both
    implementations."""
    return struct.pack(">QQB", 9 + len(payload), rid, ftype) + payload


def outcome(fn: Any, *args: Any, **kwargs: Any) -> tuple[str, Any]:
    try:
        return ("ok", fn(*args, **kwargs))
    except Exception as exc:
        return ("err", type(exc), str(exc))


# --- constants and encoding ----------------------------------------------------------------


def test_constants(impl: SimpleNamespace) -> None:
    assert (impl.FRAME_REQUEST, impl.FRAME_REPLY, impl.FRAME_ERROR) == (1, 2, 3)
    assert impl.FRAME_HEADER_SIZE == 17
    assert impl.DEFAULT_MAX_FRAME == 64 * 2**30
    assert impl.FrameError is FrameError and impl.FrameTooLarge is FrameTooLarge
    assert issubclass(FrameTooLarge, FrameError) and issubclass(FrameCorrupt, FrameError)
    assert issubclass(FrameError, ValueError)


@pytest.mark.parametrize("ftype", [0, 1, 2, 3, 4, 200, 255])
@pytest.mark.parametrize("rid", [0, 1, 2**32, U64_MAX])
def test_encode_layout(impl: SimpleNamespace, ftype: int, rid: int) -> None:
    for payload in (b"", b"x", bytes(range(256)) * 5):
        encoded = impl.encode_frame(ftype, rid, payload)
        assert type(encoded) is bytes
        assert encoded == frame(ftype, rid, payload)
        assert impl.encode_frame_header(ftype, rid, len(payload)) == encoded[:17]


def test_encode_accepts_bytes_like(impl: SimpleNamespace) -> None:
    data = bytes(range(40))
    expected = frame(2, 7, data)
    ints = array.array("I", range(10))
    cases = [
        bytearray(data),
        memoryview(data),
        memoryview(bytearray(data))[0:40],
        memoryview(data).cast("B", (5, 8)),  # 2-D but contiguous
        memoryview(data).cast("b"),
    ]
    for payload in cases:
        assert impl.encode_frame(2, 7, payload) == expected
    assert impl.encode_frame(2, 7, ints) == frame(2, 7, ints.tobytes())


@pytest.mark.parametrize(
    ("args", "kwargs", "exc", "needle"),
    [
        ((-1, 1, b""), {}, ValueError, "argument 'frame_type' must be in 0..255, got -1"),
        ((256, 1, b""), {}, ValueError, "argument 'frame_type' must be in 0..255, got 256"),
        ((1.0, 1, b""), {}, TypeError, "argument 'frame_type' must be int, not float"),
        ((1, -1, b""), {}, ValueError, "argument 'request_id'"),
        ((1, 2**64, b""), {}, ValueError, "got 18446744073709551616"),
        ((1, "1", b""), {}, TypeError, "argument 'request_id' must be int, not str"),
        ((1, 1, "text"), {}, TypeError, "argument 'payload' must be a bytes-like object"),
        ((1, 1, None), {}, TypeError, "argument 'payload'"),
        ((1, 1, memoryview(b"abcd")[::2]), {}, TypeError, "C-contiguous"),
        ((1, 1, b"abc"), {"max_frame": 8}, ValueError, "argument 'max_frame' must be >= 9"),
        ((1, 1, b"abc"), {"max_frame": -1}, ValueError, "got -1"),
        ((1, 1, b"abc"), {"max_frame": "9"}, TypeError, "argument 'max_frame'"),
        ((1, 1, b"abc"), {"max_frame": 11}, FrameTooLarge, "frame length 12"),
        ((1, 1, b"abc"), {"max_frame": 9}, FrameTooLarge, "exceeds max_frame 9"),
    ],
)
def test_encode_errors(
    args: tuple[Any, ...], kwargs: dict[str, Any], exc: type, needle: str
) -> None:
    results = [outcome(i.encode_frame, *args, **kwargs) for i in BOTH]
    assert results[0] == results[1]
    kind, cls, message = results[0]
    assert kind == "err" and cls is exc and needle in message


def test_encode_max_frame_boundaries(impl: SimpleNamespace) -> None:
    assert impl.encode_frame(1, 1, b"abc", max_frame=12) == frame(1, 1, b"abc")
    assert impl.encode_frame(1, 1, b"", max_frame=9) == frame(1, 1, b"")
    assert impl.encode_frame(1, 1, b"abc", max_frame=None) == frame(1, 1, b"abc")
    assert impl.encode_frame(1, 1, b"abc", max_frame=2**100) == frame(1, 1, b"abc")
    # The header-only encoder applies the same cap to a declared length.
    with pytest.raises(FrameTooLarge):
        impl.encode_frame_header(1, 1, 64 * 2**30 - 8)
    assert len(impl.encode_frame_header(1, 1, 64 * 2**30 - 9)) == 17
    with pytest.raises(FrameTooLarge):
        impl.encode_frame_header(1, 1, U64_MAX, max_frame=2**80)
    with pytest.raises(ValueError, match="payload_len"):
        impl.encode_frame_header(1, 1, -1)


# --- decoding ------------------------------------------------------------------------------


def test_decode_whole_and_bytewise(impl: SimpleNamespace) -> None:
    frames = [(1, 0, b"req"), (2, U64_MAX, b""), (3, 5, "boom é".encode()), (77, 9, b"x" * 3000)]
    stream = b"".join(frame(*f) for f in frames)
    assert impl.FrameDecoder().feed(stream) == frames
    dec = impl.FrameDecoder()
    got = []
    for i in range(len(stream)):
        got += dec.feed(stream[i : i + 1])
    assert got == frames
    assert all(type(payload) is bytes for _, _, payload in got)
    assert dec.buffered == 0 and dec.pending_frame_size is None and not dec.closed


def test_decode_accepts_bytes_like(impl: SimpleNamespace) -> None:
    stream = frame(1, 2, b"abc") + frame(2, 3, b"defg")
    expected = [(1, 2, b"abc"), (2, 3, b"defg")]
    for data in (bytearray(stream), memoryview(stream), memoryview(stream).cast("c")):
        assert impl.FrameDecoder().feed(data) == expected
    assert impl.FrameDecoder().feed(b"") == []
    with pytest.raises(TypeError, match="argument 'data'"):
        impl.FrameDecoder().feed("text")


def test_decoder_introspection(impl: SimpleNamespace) -> None:
    dec = impl.FrameDecoder(max_frame=1000)
    assert dec.max_frame == 1000
    wire = frame(2, 1, b"0123456789")
    assert dec.feed(wire[:5]) == []
    assert (dec.buffered, dec.pending_frame_size) == (5, None)
    assert dec.feed(wire[5:10]) == []
    assert (dec.buffered, dec.pending_frame_size) == (10, len(wire))
    assert dec.feed(wire[10:20]) == []
    assert (dec.buffered, dec.pending_frame_size) == (20, len(wire))
    assert dec.feed(wire[20:] + wire[:3]) == [(2, 1, b"0123456789")]
    assert (dec.buffered, dec.pending_frame_size) == (3, None)
    assert impl.FrameDecoder().max_frame == 64 * 2**30
    with pytest.raises(ValueError, match="max_frame"):
        impl.FrameDecoder(max_frame=3)


def _poisoned(dec: Any) -> None:
    assert dec.closed
    for data in (b"", frame(1, 1, b"ok")):
        with pytest.raises(FrameError, match="closed after an earlier error") as info:
            dec.feed(data)
        assert type(info.value) is FrameError


def test_corrupt_length_poisons(impl: SimpleNamespace) -> None:
    for length in range(9):
        dec = impl.FrameDecoder()
        good = frame(1, 1, b"ok")
        assert dec.feed(good) == [(1, 1, b"ok")]
        with pytest.raises(FrameCorrupt, match=f"stream offset {len(good)}: length field"):
            # Reported once the 8 length bytes are in, before the rest of the header.
            dec.feed(struct.pack(">Q", length))
        _poisoned(dec)


def test_oversize_poisons_early(impl: SimpleNamespace) -> None:
    dec = impl.FrameDecoder(max_frame=100)
    assert dec.feed(frame(1, 1, b"x" * 91)) == [(1, 1, b"x" * 91)]  # exactly at the cap
    dec.feed(struct.pack(">Q", 101)[:7])
    with pytest.raises(FrameTooLarge, match="above max_frame 100"):
        dec.feed(b"\x65")
    _poisoned(dec)
    # Frames completed earlier in the failing call are discarded with it.
    dec = impl.FrameDecoder(max_frame=100)
    with pytest.raises(FrameTooLarge):
        dec.feed(frame(1, 1, b"ok") + struct.pack(">QQB", 2**63, 1, 1))
    _poisoned(dec)


def test_exception_classes_are_shared() -> None:
    for impl in BOTH:
        with pytest.raises(FrameError) as info:
            impl.FrameDecoder(max_frame=10).feed(struct.pack(">QQB", 11, 0, 0))
        assert type(info.value) is errors.FrameTooLarge


# --- hypothesis: frames --------------------------------------------------------------------

frames_st = st.lists(
    st.tuples(st.integers(0, 255), st.integers(0, U64_MAX), st.binary(max_size=600)),
    max_size=12,
)


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, start = [], 0
    for p in [*points, len(data)]:
        pieces.append(data[start:p])
        start = p
    return pieces


@given(frames=frames_st, cuts=st.lists(st.integers(0, 10**6), max_size=30))
@settings(max_examples=300)
def test_roundtrip_random_splits(frames: list[tuple[int, int, bytes]], cuts: list[int]) -> None:
    stream = b"".join(RUST.encode_frame(*f) for f in frames)
    assert stream == b"".join(PY.encode_frame(*f) for f in frames)
    assert stream == b"".join(frame(*f) for f in frames)
    for impl in BOTH:
        dec = impl.FrameDecoder()
        got: list[tuple[int, int, bytes]] = []
        for piece in split(stream, cuts):
            got += dec.feed(piece)
        assert got == frames
        assert dec.buffered == 0


@given(
    frames=frames_st,
    bad_length=st.one_of(st.integers(0, 8), st.integers(201, U64_MAX)),
    tail=st.binary(max_size=40),
    cuts=st.lists(st.integers(0, 10**6), max_size=20),
)
@settings(max_examples=300)
def test_bad_header_parity(
    frames: list[tuple[int, int, bytes]], bad_length: int, tail: bytes, cuts: list[int]
) -> None:
    frames = [(t, r, p[:150]) for t, r, p in frames]  # keep every good frame under the cap
    stream = b"".join(frame(*f) for f in frames) + struct.pack(">Q", bad_length) + tail
    expected_exc = FrameCorrupt if bad_length < 9 else FrameTooLarge
    traces = []
    for impl in BOTH:
        dec = impl.FrameDecoder(max_frame=200)
        trace: list[Any] = []
        for piece in split(stream, cuts):
            result = outcome(dec.feed, piece)
            trace.append(result)
            if result[0] == "err":
                break
        traces.append(trace)
        assert trace[-1][0] == "err" and trace[-1][1] is expected_exc
        _poisoned(dec)
    assert traces[0] == traces[1]


# --- envelope ------------------------------------------------------------------------------

REQUEST_META = {
    "op": "chat",
    "session_id": "0123456789abcdef0123456789abcdef",
    "path": "/v1/chat/completions",
    "method": "POST",
    "query": "",
    "headers": {"content-type": "application/json", "x-note": 'quote " back \\ é 🚀\n'},
}


def test_envelope_layout_and_roundtrip(impl: SimpleNamespace) -> None:
    body = b'{"messages": []}'
    env = impl.encode_envelope(REQUEST_META, body)
    text = json.dumps(REQUEST_META, separators=(",", ":"), ensure_ascii=False).encode()
    assert env == struct.pack(">Q", len(text)) + text + body
    meta, got_body = impl.decode_envelope(env)
    assert meta == REQUEST_META
    assert isinstance(got_body, memoryview) and got_body == body
    assert impl.encode_envelope({}) == impl.encode_envelope({}, b"") == b"\0" * 7 + b"\x02{}"
    assert impl.encode_envelope({}, None) == impl.encode_envelope({})
    assert impl.encode_envelope({"a": 1}, bytearray(b"xy")).endswith(b"xy")
    assert impl.encode_envelope({"a": 1}, array.array("H", [1])).endswith(b"\x01\x00")


def test_envelope_body_is_not_copied(impl: SimpleNamespace) -> None:
    payload = impl.encode_envelope({"op": "health"}, b"B" * 100_000)
    _, body = impl.decode_envelope(payload)
    assert body.obj is payload  # a view of the payload itself
    assert body.nbytes == 100_000 and body.format == "B"
    buf = bytearray(payload)
    _, body = impl.decode_envelope(buf)
    buf[-1] = ord("Z")
    assert body[-1] == ord("Z")
    _, body = impl.decode_envelope(memoryview(payload).cast("c"))
    assert body.format == "B" and body.nbytes == 100_000


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        (b"", "need 8 bytes for meta_len, got 0"),
        (b"\0\0\0", "need 8 bytes for meta_len, got 3"),
        (struct.pack(">Q", 5) + b"{}", "meta_len 5 runs past the end of the 10-byte payload"),
        (struct.pack(">Q", U64_MAX) + b"{}", "runs past the end"),
        (struct.pack(">Q", 0), "offset 8 is not valid JSON"),
        (struct.pack(">Q", 2) + b"[]", "must be a JSON object, got array"),
        (struct.pack(">Q", 4) + b"null", "got null"),
        (struct.pack(">Q", 2) + b"12", "got number"),
        (struct.pack(">Q", 4) + b'"x" ', "got string"),
        (struct.pack(">Q", 4) + b"true", "got boolean"),
        (struct.pack(">Q", 3) + b"{\xff}", "offset 9 is not valid UTF-8"),
        (struct.pack(">Q", 6) + b'{"a":}', "offset 13 is not valid JSON"),
        (struct.pack(">Q", 5) + b"{} {}", "offset 11 is not valid JSON"),
        (struct.pack(">Q", 9) + b'{"a":"\x01"}', "offset 14 is not valid JSON"),
        (struct.pack(">Q", 12) + b'{"a":"\\ud8"}', "not valid JSON"),
        (struct.pack(">Q", 5008) + b'{"a":' + b"1" * 5000 + b"}" + b"  ", "not valid JSON"),
        (struct.pack(">Q", 4000) + b"[" * 2000 + b"]" * 2000, "not valid JSON"),
    ],
)
def test_decode_envelope_errors(payload: bytes, needle: str) -> None:
    results = [outcome(i.decode_envelope, payload) for i in BOTH]
    for kind, cls, message in results:
        assert kind == "err" and cls is FrameError, message
        assert needle in message, message
    assert results[0][1] is results[1][1]


def test_decode_envelope_type_errors(impl: SimpleNamespace) -> None:
    with pytest.raises(TypeError, match="argument 'payload'"):
        impl.decode_envelope("text")
    with pytest.raises(TypeError, match="argument 'meta' must be dict, not list"):
        impl.encode_envelope([], b"")
    with pytest.raises(TypeError, match="argument 'body'"):
        impl.encode_envelope({}, "text")


@pytest.mark.parametrize(
    "meta",
    [
        {"a": {1, 2}},
        {"a": b"bytes"},
        {"a": object()},
        {(1, 2): "tuple key"},
        {"a": [1, 2, {"b": 1j}]},
        {"a": "\ud800"},
        {"\udfff": 1},
    ],
)
def test_encode_envelope_rejects_non_json(meta: dict[Any, Any]) -> None:
    results = [outcome(i.encode_envelope, meta) for i in BOTH]
    assert results[0][0] == "err"
    assert results[0][1] is results[1][1]
    assert results[0][1] in (TypeError, UnicodeEncodeError)


def test_encode_envelope_circular() -> None:
    loop: dict[str, Any] = {}
    loop["self"] = loop
    items: list[Any] = []
    items.append(items)
    for meta in (loop, {"a": items}):
        results = [outcome(i.encode_envelope, meta) for i in BOTH]
        assert results[0] == results[1] == ("err", ValueError, "Circular reference detected")
    shared = [1]
    assert RUST.encode_envelope({"a": shared, "b": shared}) == PY.encode_envelope(
        {"a": shared, "b": shared}
    )


def test_encode_envelope_python_json_quirks() -> None:
    class IntSub(int):
        def __repr__(self) -> str:
            return "nope"

    class StrSub(str):
        pass

    class DictSub(dict):  # type: ignore[type-arg]
        pass

    meta = {
        "floats": [0.0, -0.0, 1e16, 1e15, 1e-5, 0.0001, 1.5, 5e-324, 1.7976931348623157e308],
        "special": [math.inf, -math.inf, math.nan],
        "ints": [0, -1, 2**63, -(2**63) - 1, 2**200, True, False, IntSub(5)],
        "keys": {
            7: "int",
            2.5: "float",
            True: "t",
            False: "f",
            None: "none",
            StrSub("s"): DictSub(x=[1.5]),
        },
        "tuple": (1, "two", None),
        "controls": "".join(chr(i) for i in range(0x20)) + "\x7f\u2028\ufeff",
    }
    rust_env = RUST.encode_envelope(meta)
    assert rust_env == PY.encode_envelope(meta)
    text = json.dumps(meta, separators=(",", ":"), ensure_ascii=False).encode()
    assert rust_env[8:] == text


def test_decode_envelope_python_json_quirks() -> None:
    text = (
        ' {"nan": NaN, "inf": [Infinity, -Infinity], "big": 123456789012345678901234567890,'
        ' "neg0": -0, "negf": -0.0, "e": [1E5, 1e-2, 2.5e+3], "dup": 1, "dup": 2,'
        ' "esc": "\\u00e9\\ud83d\\ude80\\ud800x\\udc00\\n\\/\\"", "raw": "é\x7f",'
        ' "nested": {"a": [[], {}, [null, true, false]]}}\r\n '
    ).encode()
    payload = struct.pack(">Q", len(text)) + text
    metas = [i.decode_envelope(payload)[0] for i in BOTH]
    assert repr(metas[0]) == repr(metas[1]) == repr(json.loads(text))
    assert list(metas[0]) == list(json.loads(text))


# --- hypothesis: envelope ------------------------------------------------------------------

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=30,
)
metas = st.dictionaries(st.text(max_size=20), json_values, max_size=8)


@given(meta=metas, body=st.binary(max_size=200))
@settings(max_examples=300)
def test_envelope_parity(meta: dict[str, Any], body: bytes) -> None:
    env = RUST.encode_envelope(meta, body)
    assert env == PY.encode_envelope(meta, body)
    for impl in BOTH:
        got_meta, got_body = impl.decode_envelope(env)
        assert repr(got_meta) == repr(meta)
        assert bytes(got_body) == body


@given(st.floats(allow_nan=True, allow_infinity=True))
@settings(max_examples=1000)
def test_float_formatting_parity(value: float) -> None:
    assert RUST.encode_envelope({"v": value}) == PY.encode_envelope({"v": value})


@given(st.integers(0, 2**64 - 1))
@settings(max_examples=1000)
def test_float_bits_parity(bits: int) -> None:
    value = struct.unpack("<d", struct.pack("<Q", bits))[0]
    meta = {"v": value, str(value): [value]}
    env = RUST.encode_envelope(meta)
    assert env == PY.encode_envelope(meta)
    assert repr(RUST.decode_envelope(env)[0]) == repr(PY.decode_envelope(env)[0])


# JSON-looking text: single characters plus whole tokens (escapes, constants) so that the
# fuzzer reaches the interesting corners of the grammar often.
json_ish = st.lists(
    st.sampled_from(
        [
            *'{}[]":,-+.0123456789eEtrufalsnNIiy \t\n\r\\/bu\x00\x1f\x7fé🚀',
            *["\\u00e9", "\\ud800", "\\udc00", "\\ud83d\\ude80", "NaN", "Infinity", "true"],
        ]
    ),
    max_size=40,
).map("".join)


@given(st.one_of(json_ish, metas.map(json.dumps)), st.binary(max_size=3))
@settings(max_examples=1000)
def test_decode_fuzz_parity(text: str, junk: bytes) -> None:
    raw = text.encode("utf-8", "surrogatepass") + junk
    payload = struct.pack(">Q", len(raw)) + raw
    results = []
    for impl in BOTH:
        kind, *rest = outcome(impl.decode_envelope, payload)
        if kind == "ok":
            results.append(("ok", repr(rest[0][0])))
        else:
            assert rest[0] is FrameError, rest
            results.append(("err",))
    assert results[0] == results[1]
    try:
        expected = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        assert results[0] == ("err",)
    else:
        assert results[0] == (("ok", repr(expected)) if type(expected) is dict else ("err",))


# --- large payloads and threads ------------------------------------------------------------


def test_large_frames_split_and_whole(impl: SimpleNamespace) -> None:
    # Above the 1 MiB threshold where the Rust core copies with the GIL released.
    big = bytes(range(256)) * (5 * 4096 + 3)
    wire = impl.encode_frame(2, 42, big) + impl.encode_frame(3, 43, b"tail")
    assert wire == frame(2, 42, big) + frame(3, 43, b"tail")
    dec = impl.FrameDecoder()
    got = []
    for start in range(0, len(wire), 2 * 1024 * 1024 + 7):
        got += dec.feed(memoryview(wire)[start : start + 2 * 1024 * 1024 + 7])
    assert got == [(2, 42, big), (3, 43, b"tail")]
    assert impl.FrameDecoder().feed(wire) == got
    env = impl.encode_envelope({"op": "chat"}, big)
    assert impl.decode_envelope(env)[1] == big


def test_rust_allocation_failure_closes_decoder() -> None:
    # The Rust decoder allocates the payload once the header is complete; an impossible
    # size fails right there and, since the header is consumed, closes the decoder.
    dec = RUST.FrameDecoder(max_frame=2**63)
    with pytest.raises(MemoryError):
        dec.feed(struct.pack(">QQB", 2**62, 1, 1) + b"x")
    _poisoned(dec)


def test_concurrent_use_from_threads() -> None:
    import threading

    keys = [f"{i:032x}" for i in range(20_000)]
    expected = PY.shard_indices(keys, 97)
    wire = b"".join(frame(2, i, bytes([i % 256]) * 3000) for i in range(300)) * 2
    errors_seen: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(5):
                assert RUST.shard_indices(keys, 97) == expected
                dec = RUST.FrameDecoder()
                frames = dec.feed(wire)
                assert len(frames) == 600 and frames[5] == (2, 5, b"\x05" * 3000)
        except BaseException as exc:
            errors_seen.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors_seen == []

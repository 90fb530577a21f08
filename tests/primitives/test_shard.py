"""Shard selection and session ids: fixed vectors, Rust == Python twin, error parity."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import uuid
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessiongate import primitives
from sessiongate.primitives import get_impl

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs


@pytest.fixture(params=["rust", "python"])
def impl(request: pytest.FixtureRequest) -> SimpleNamespace:
    return get_impl(request.param)


RUST = get_impl("rust")
PY = get_impl("python")


def reference(key: str | bytes, n: int) -> int:
    data = key.encode() if isinstance(key, str) else key
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big") % n


KEYS: list[str | bytes] = [
    "",
    "a",
    "0123456789abcdef0123456789abcdef",
    "6f1c2d3e4a5b4c6d8e9fa0b1c2d3e4f5.0a1b2c3d4e5f40718293a4b5c6d7e8f9",
    "café ☕ 🚀",
    "x" * 127,
    "y" * 128,
    "z" * 129,
    "w" * 1000,
    b"",
    b"\x00\xff\x80",
    bytes(range(256)),
]
MODULI = [1, 2, 3, 16, 1000]


@pytest.mark.parametrize("n", MODULI)
def test_fixed_vectors(impl: SimpleNamespace, n: int) -> None:
    for key in KEYS:
        assert impl.shard_index(key, n) == reference(key, n), key
    assert impl.shard_indices(KEYS, n) == [reference(k, n) for k in KEYS]


def test_known_answer() -> None:
    # Pinned so a change of hash function is caught even if both twins change together.
    h = int.from_bytes(hashlib.blake2b(b"abc", digest_size=8).digest(), "big")
    assert h == 0xD8BB14D833D59559
    assert RUST.shard_index("abc", 2**64) == PY.shard_index("abc", 2**64) == h


def test_str_and_bytes_keys_agree(impl: SimpleNamespace) -> None:
    for key in KEYS:
        if isinstance(key, str):
            assert impl.shard_index(key, 1000) == impl.shard_index(key.encode(), 1000)


def test_batch_accepts_any_iterable(impl: SimpleNamespace) -> None:
    expected = [reference(k, 7) for k in KEYS]
    assert impl.shard_indices(tuple(KEYS), 7) == expected
    assert impl.shard_indices(iter(KEYS), 7) == expected
    assert impl.shard_indices((k for k in KEYS), 7) == expected
    assert impl.shard_indices([], 7) == []


def test_large_batch_crosses_simd_and_gil_paths(impl: SimpleNamespace) -> None:
    keys: list[str | bytes] = [uuid.uuid4().hex for _ in range(5000)]
    keys += [os.urandom(i % 300) for i in range(700)]
    assert impl.shard_indices(keys, 1000) == [reference(k, 1000) for k in keys]


def test_huge_and_bool_moduli(impl: SimpleNamespace) -> None:
    # Python's h % n with n above every u64 is h itself; bools are ints.
    for n in (2**64 - 1, 2**64, 2**70):
        assert impl.shard_index("abc", n) == reference("abc", n)
    assert impl.shard_index("abc", True) == 0
    assert impl.shard_indices(["abc"], 2**80) == [reference("abc", 2**80)]


def test_subclasses(impl: SimpleNamespace) -> None:
    class S(str):
        pass

    class B(bytes):
        pass

    class N(int):
        pass

    assert impl.shard_index(S("abc"), N(16)) == reference("abc", 16)
    assert impl.shard_index(B(b"abc"), 16) == reference(b"abc", 16)
    assert impl.shard_indices([S("abc"), B(b"abc")], N(16)) == [reference("abc", 16)] * 2


def _error(fn: object, *args: object) -> BaseException:
    with pytest.raises(Exception) as info:
        fn(*args)  # type: ignore[operator]
    return info.value


@pytest.mark.parametrize(
    ("func", "args", "exc", "needle"),
    [
        ("shard_index", ("abc", 0), ValueError, "n must be >= 1, got 0"),
        ("shard_index", ("abc", -5), ValueError, "n must be >= 1, got -5"),
        ("shard_index", ("abc", -(2**70)), ValueError, "got -1180591620717411303424"),
        ("shard_index", ("abc", 1.5), TypeError, "argument 'n'"),
        ("shard_index", ("abc", "3"), TypeError, "argument 'n'"),
        ("shard_index", ("abc", None), TypeError, "argument 'n'"),
        ("shard_index", (5, 3), TypeError, "argument 'key' must be str or bytes, not int"),
        ("shard_index", (bytearray(b"x"), 3), TypeError, "argument 'key'"),
        ("shard_index", (memoryview(b"x"), 3), TypeError, "argument 'key'"),
        ("shard_index", (None, 3), TypeError, "argument 'key'"),
        ("shard_indices", (["a", 5], 3), TypeError, "argument 'keys' item 1"),
        ("shard_indices", ("abc", 3), TypeError, "argument 'keys'"),
        ("shard_indices", (b"abc", 3), TypeError, "argument 'keys'"),
        ("shard_indices", (5, 3), TypeError, ""),
        ("shard_indices", (["a"], 0), ValueError, "n must be >= 1, got 0"),
        ("shard_key", (b"a.b",), TypeError, "argument 'session_id'"),
        ("validate_session_id", (5,), TypeError, "argument 'session_id'"),
        ("new_session_id", (5,), TypeError, "argument 'parent'"),
    ],
)
def test_error_parity(func: str, args: tuple[object, ...], exc: type, needle: str) -> None:
    rust_err = _error(getattr(RUST, func), *args)
    py_err = _error(getattr(PY, func), *args)
    assert type(rust_err) is type(py_err)
    assert isinstance(rust_err, exc)
    assert needle in str(rust_err)
    assert needle in str(py_err)
    if needle:
        assert str(rust_err) == str(py_err)


def test_surrogate_key_is_unencodable_in_both() -> None:
    for impl in (RUST, PY):
        with pytest.raises(UnicodeEncodeError):
            impl.shard_index("a\ud800b", 3)
        with pytest.raises(UnicodeEncodeError):
            impl.shard_indices(["ok", "a\udfffb"], 3)


@given(
    key=st.one_of(st.text(), st.binary(max_size=300)),
    n=st.one_of(st.integers(1, 2**16), st.integers(1, 2**64 + 5)),
)
def test_rust_equals_python_single(key: str | bytes, n: int) -> None:
    assert RUST.shard_index(key, n) == PY.shard_index(key, n) == reference(key, n)


@given(
    keys=st.lists(st.one_of(st.text(max_size=200), st.binary(max_size=200)), max_size=150),
    n=st.integers(1, 2**64 - 1),
)
@settings(max_examples=200)
def test_rust_equals_python_batch(keys: list[str | bytes], n: int) -> None:
    assert RUST.shard_indices(keys, n) == PY.shard_indices(keys, n)
    assert RUST.shard_indices(keys, n) == [RUST.shard_index(k, n) for k in keys]


def test_hash_seed_independence() -> None:
    """The same owners in fresh interpreters under different PYTHONHASHSEED values."""
    keys = ["", "abc", "0123456789abcdef0123456789abcdef", "café.x", "a" * 200]
    script = (
        "import json, sys\n"
        "from sessiongate.primitives import get_impl\n"
        "keys = json.loads(sys.argv[1])\n"
        "print(json.dumps({name: [get_impl(name).shard_indices(keys, n) for n in (1, 3, 16, 1000)]"
        " for name in ('rust', 'python')}))\n"
    )
    results = []
    for seed in ("0", "1", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        env.pop("SESSIONGATE_IMPL", None)
        proc = subprocess.run(
            [sys.executable, "-c", script, json.dumps(keys)],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=True,
        )
        results.append(json.loads(proc.stdout))
    expected = [[reference(k, n) for k in keys] for n in (1, 3, 16, 1000)]
    for result in results:
        assert result == {"rust": expected, "python": expected}


# --- shard_key / session ids ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("session_id", "key"),
    [("abc", "abc"), ("a.b", "a"), ("a.b.c", "a"), (".x", ""), ("", ""), ("x.", "x"), ("é.ü", "é")],
)
def test_shard_key(impl: SimpleNamespace, session_id: str, key: str) -> None:
    assert impl.shard_key(session_id) == key


def test_shard_key_surrogates_and_subclass(impl: SimpleNamespace) -> None:
    assert impl.shard_key("\ud800.x") == "\ud800"

    class S(str):
        pass

    whole = S("abc")
    assert impl.shard_key(whole) is whole  # like str.partition: the object itself
    assert type(impl.shard_key(S("a.b"))) is str


HEX32 = re.compile(r"[0-9a-f]{32}")


def test_new_root_ids(impl: SimpleNamespace) -> None:
    ids = {impl.new_session_id() for _ in range(2000)}
    assert len(ids) == 2000
    for sid in list(ids)[:200]:
        assert HEX32.fullmatch(sid)
        assert uuid.UUID(hex=sid).version == 4
    assert impl.new_session_id(None) != impl.new_session_id(None)


def test_child_ids_share_the_root(impl: SimpleNamespace) -> None:
    root = impl.new_session_id()
    child = impl.new_session_id(root)
    grandchild = impl.new_session_id(child)
    for sid in (child, grandchild):
        prefix, _, tail = sid.partition(".")
        assert prefix == root
        assert HEX32.fullmatch(tail)
        assert impl.shard_key(sid) == root
        assert impl.shard_index(impl.shard_key(sid), 16) == impl.shard_index(root, 16)
    assert impl.validate_session_id(grandchild) == grandchild
    # A client-supplied parent with a long root still yields a valid id, up to the limit.
    long_root = "r" * (256 - 33)
    assert len(impl.new_session_id(long_root + ".x")) == 256


@pytest.mark.parametrize(
    ("parent", "needle"),
    [
        ("", "got 0"),
        ("a b", "U+0020 at position 1"),
        ("r" * 224, "would exceed 256"),
        ("x" * 257, "got 257"),
    ],
)
def test_bad_parent(parent: str, needle: str) -> None:
    errors = [_error(impl.new_session_id, parent) for impl in (RUST, PY)]
    for err in errors:
        assert type(err) is ValueError
        assert needle in str(err)
    assert str(errors[0]) == str(errors[1])


def test_validate_returns_same_object(impl: SimpleNamespace) -> None:
    for sid in ("a", "!" * 256, "~x.y-Z_09", "0123456789abcdef0123456789abcdef"):
        assert impl.validate_session_id(sid) is sid


@pytest.mark.parametrize(
    ("sid", "needle"),
    [
        ("", "must be 1-256 characters long, got 0"),
        ("a" * 257, "got 257"),
        ("é" * 300, "got 300"),
        ("abc def", "U+0020 at position 3"),
        ("abc\x00", "U+0000 at position 3"),
        ("ab\x7f", "U+007F at position 2"),
        ("\tab", "U+0009 at position 0"),
        ("abcé", "U+00E9 at position 3"),
        ("ab\ud800", "U+D800 at position 2"),
        ("🚀", "U+1F680 at position 0"),
    ],
)
def test_validate_rejects(sid: str, needle: str) -> None:
    errors = [_error(impl.validate_session_id, sid) for impl in (RUST, PY)]
    for err in errors:
        assert type(err) is ValueError
        assert needle in str(err)
    assert str(errors[0]) == str(errors[1])


@given(st.text(max_size=300))
def test_validate_parity(sid: str) -> None:
    outcomes = []
    for impl in (RUST, PY):
        try:
            outcomes.append(("ok", impl.validate_session_id(sid)))
        except ValueError as exc:
            outcomes.append(("err", str(exc)))
    assert outcomes[0] == outcomes[1]
    valid = 1 <= len(sid) <= 256 and all("!" <= c <= "~" for c in sid)
    assert (outcomes[0][0] == "ok") == valid


def test_facade_exports_active_impl() -> None:
    assert primitives.IMPL in ("rust", "python")
    active = get_impl(primitives.IMPL)  # type: ignore[arg-type]
    assert primitives.shard_index is active.shard_index
    assert primitives.MAX_SESSION_ID_LEN == 256


@pytest.mark.parametrize(
    ("value", "expected"), [("python", "python"), ("rust", "rust"), (None, "rust")]
)
def test_impl_selection(value: str | None, expected: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SESSIONGATE_IMPL"}
    if value is not None:
        env["SESSIONGATE_IMPL"] = value
    code = (
        "from sessiongate import primitives as p\n"
        "assert p.shard_index is p.get_impl(p.IMPL).shard_index\n"
        "print(p.IMPL)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == expected


def test_impl_selection_rejects_unknown_values() -> None:
    env = {**os.environ, "SESSIONGATE_IMPL": "cython"}
    proc = subprocess.run(
        [sys.executable, "-c", "import sessiongate.primitives"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "ValueError: SESSIONGATE_IMPL='cython' is not supported" in proc.stderr


@pytest.mark.parametrize(
    ("value", "outcome"),
    [(None, "python+warning"), ("python", "python"), ("rust", "ImportError")],
)
def test_impl_selection_without_core(value: str | None, outcome: str) -> None:
    # Simulate a source checkout without a built extension.
    code = (
        "import sys, warnings\n"
        "sys.modules['sessiongate._core'] = None\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    try:\n"
        "        from sessiongate import primitives as p\n"
        "    except ImportError:\n"
        "        print('ImportError'); raise SystemExit\n"
        "assert p.rust is None and p.shard_index('abc', 1) == 0\n"
        "print(p.IMPL + ('+warning' if any('pure-Python' in str(w.message) for w in seen) else ''))"
    )
    env = {k: v for k, v in os.environ.items() if k != "SESSIONGATE_IMPL"}
    if value is not None:
        env["SESSIONGATE_IMPL"] = value
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == outcome

"""Session routing stamping primitives: HeaderStamper and nvext_session_control.

The Rust core and the pure-Python twin must agree: equal header dicts (same order), request
bodies that parse equal (byte-equal for compact bodies without duplicate keys), same exception
classes and messages. Generated bodies vary whitespace, escapes, duplicate keys, unicode, and
the shape of `nvext` / `session_control`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from enum import IntEnum
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sessiongate._core as core
from sessiongate.primitives import get_impl
from sessiongate.primitives.errors import RequestRewriteError
from sessiongate.primitives.header_names import RESERVED_HEADER_NAMES, validate_header_name
from sessiongate.session_routing import (
    DynamoHeaders,
    DynamoNvext,
    IdentityHeaders,
    RoutingContext,
    SessionIdHeader,
    SessionRoutingMode,
    SmgRoutingKey,
)
from sessiongate.session_routing.stamper import SessionStamper
from support.json_models import Obj, Writer, plain

RUST = get_impl("rust")
PY = get_impl("python")
IMPLS = (RUST, PY)
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ROOT = "0123456789abcdef0123456789abcdef"
CHILD = f"{ROOT}.fedcba9876543210fedcba9876543210"


def outcome(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, ...]:
    try:
        return ("ok", fn(*args, **kwargs))
    except Exception as exc:
        return ("err", type(exc), str(exc))


# --- HeaderStamper -----------------------------------------------------------------------------

TCHARS = "!#$%&'*+-.^_`|~" + "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
tokens = st.text(alphabet=TCHARS, min_size=1, max_size=24)
# Anything a user might type: mostly tokens, sometimes a bad character, a reserved name.
any_names = (
    tokens
    | st.text(max_size=8)
    | st.sampled_from(
        [
            "",
            "X Session",
            "a:b",
            "é",
            'q"',
            "a\r\nb",
            "x\ud800y",
            "Host",
            "CONTENT-length",
            "te",
            "Te",
            "tee",
            "a'b",
        ]
    )
)
ids = st.text(max_size=40) | st.sampled_from([ROOT, CHILD, "", "é😀", 'q"\\'])


def reference_stamp(
    tiers: tuple[list[str], list[str], list[str]], sid: str, parent: str | None, root: str
) -> list[tuple[str, str]]:
    out = [(n, sid) for n in tiers[0]]
    if parent is not None:
        out += [(n, parent) for n in tiers[1]]
    return out + [(n, root) for n in tiers[2]]


@st.composite
def valid_tiers(draw: st.DrawFn) -> tuple[list[str], list[str], list[str]]:
    names = draw(st.lists(tokens, max_size=7, unique_by=str.lower))
    names = [n for n in names if n.lower() not in RESERVED_HEADER_NAMES]
    cut1 = draw(st.integers(0, len(names)))
    cut2 = draw(st.integers(cut1, len(names)))
    return names[:cut1], names[cut1:cut2], names[cut2:]


@SETTINGS
@given(valid_tiers(), ids, st.none() | ids, ids, st.booleans())
def test_stamp_agrees(tiers, sid, parent, root, as_tuples):
    args = tuple(tuple(t) for t in tiers) if as_tuples else tiers
    want = reference_stamp(tiers, sid, parent, root)
    for impl in IMPLS:
        stamper = impl.HeaderStamper(*args)
        out = stamper.stamp(sid, parent, root)
        assert type(out) is dict
        assert list(out.items()) == want
        assert (stamper.session, stamper.parent, stamper.root) == tuple(tuple(t) for t in tiers)
        assert stamper.stamp(sid, parent, root) is not out  # a new dict every call


@SETTINGS
@given(st.lists(st.lists(any_names, max_size=3), min_size=3, max_size=3))
def test_validation_agrees(tiers):
    r = outcome(RUST.HeaderStamper, *tiers)
    p = outcome(PY.HeaderStamper, *tiers)
    if r[0] == "ok":
        assert p[0] == "ok" and repr(r[1]) == repr(p[1])
    else:
        assert r == p
    # The same rules as primitives/header_names.py, name by name.
    for names in tiers:
        for name in names:
            single = outcome(RUST.HeaderStamper, [name], [], [])
            check = outcome(validate_header_name, name)
            assert single[0] == check[0]
            if check[0] == "err":
                assert single == check


def test_validation_messages():
    cases: list[tuple[tuple[Any, ...], type[Exception], str]] = [
        ((["X Session"], [], []), ValueError, "header name 'X Session' is not an RFC 9110 token"),
        ((["x\ud800:é"], [], []), ValueError, "(offending characters: ':', 'é', '\\ud800')"),
        ((["ok", ""], [], []), ValueError, "header name is empty"),
        (
            ([], ["Content-Type"], []),
            ValueError,
            "header name 'Content-Type' is set by the gateway itself",
        ),
        (
            (["X-Key"], [], ["x-key"]),
            ValueError,
            "header name 'x-key' appears in session and root (as 'X-Key' and 'x-key'; "
            "names are compared case-insensitively); give each header one job",
        ),
        ((["a", "A"], [], []), ValueError, "header name 'A' appears twice in session"),
        (
            ("X-Key", [], []),
            TypeError,
            "HeaderStamper() argument 'session' must be a list or tuple of str, not str",
        ),
        (
            ([], None, []),
            TypeError,
            "HeaderStamper() argument 'parent' must be a list or tuple of str, not NoneType",
        ),
        (
            ([], [], ["a", 1]),
            TypeError,
            "HeaderStamper() argument 'root' item 1 must be str, not int",
        ),
    ]
    for args, cls, fragment in cases:
        r, p = outcome(RUST.HeaderStamper, *args), outcome(PY.HeaderStamper, *args)
        assert r == p, args
        assert r[1] is cls and fragment in r[2], (args, r)


def test_stamp_type_errors_agree():
    stampers = [impl.HeaderStamper(["A"], ["P"], ["R"]) for impl in IMPLS]
    for args in [
        (1, None, "r"),
        (b"s", None, "r"),
        ("s", 2, "r"),
        ("s", b"p", "r"),
        ("s", None, None),
        ("s", "p", 3.5),
    ]:
        r, p = (outcome(s.stamp, *args) for s in stampers)
        assert r == p and r[0] == "err" and r[1] is TypeError, args
        assert r[2].startswith("stamp() argument '")


def test_stamp_binds_arguments_like_a_python_method():
    stampers = [impl.HeaderStamper(["A"], ["P"], ["R"]) for impl in IMPLS]
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        (("s", "p"), {"root_id": "r"}),
        ((), {"root_id": "r", "session_id": "s", "parent_id": None}),
        (("s",), {"parent_id": "p", "root_id": "r"}),
        ((), {}),
        (("s",), {}),
        (("s", "p"), {}),
        (("s", "p", "r", "x"), {}),
        (("s", "p", "r"), {"x": 1}),
        (("s",), {"session_id": "t", "parent_id": None, "root_id": "r"}),
        ((), {"root_id": "r"}),
        (("s", None), {"root_id": 5}),
    ]
    for args, kwargs in calls:
        r, p = (outcome(s.stamp, *args, **kwargs) for s in stampers)
        assert r == p, (args, kwargs)


def test_stamp_keeps_reference_counts():
    """The Rust stamp is a raw C-API method: no reference leaks or losses on any path."""
    sid, pid, rid = "".join(["s", "1"]), "".join(["p", "1"]), "".join(["r", "1"])
    stamper = RUST.HeaderStamper(["A", "B"], ["P"], ["R"])
    (name, *_) = stamper.session
    before = [sys.getrefcount(x) for x in (sid, pid, rid, name)]
    for _ in range(1_000):
        stamper.stamp(sid, pid, rid)
        stamper.stamp(sid, None, root_id=rid)
        outcome(stamper.stamp, sid, 1, rid)
        outcome(stamper.stamp, sid, pid, rid, x=1)
    assert [sys.getrefcount(x) for x in (sid, pid, rid, name)] == before


def test_reserved_names_match_the_routing_rules():
    assert set(core.reserved_header_names()) == RESERVED_HEADER_NAMES
    for name in RESERVED_HEADER_NAMES:
        for spelled in (name, name.upper(), name.title()):
            r = outcome(RUST.HeaderStamper, [spelled], [], [])
            assert r == outcome(PY.HeaderStamper, [spelled], [], [])
            assert r[0] == "err" and "set by the gateway itself" in r[2]


def test_names_are_interned_and_read_only():
    for impl in IMPLS:
        name = "".join(["X-", "Dynamic"])  # a new, non-interned str
        stamper = impl.HeaderStamper([name], (), [])
        (key,) = stamper.stamp("s", None, "r")
        assert key == name and sys.intern(key) is key
        with pytest.raises(AttributeError):
            stamper.session = ("Y",)  # type: ignore[misc]
    assert repr(RUST.HeaderStamper(["a'b"], [], ["R"])) == repr(
        PY.HeaderStamper(["a'b"], [], ["R"])
    )
    assert repr(PY.HeaderStamper(["a'b"], [], ["R"])) == (
        "HeaderStamper(session=(\"a'b\",), parent=(), root=('R',))"
    )


def root_ctx(final: bool = False) -> RoutingContext:
    return RoutingContext(ROOT, None, ROOT, is_final_turn=final)


def child_ctx(final: bool = False) -> RoutingContext:
    return RoutingContext(CHILD, ROOT, ROOT, is_final_turn=final, is_parent_final=False)


def test_header_modes_are_header_stampers():
    modes: list[tuple[SessionRoutingMode, tuple[list[str], list[str], list[str]]]] = [
        (DynamoHeaders(), (["X-Dynamo-Session-ID"], ["X-Dynamo-Parent-Session-ID"], [])),
        (SmgRoutingKey(), (["X-SMG-Routing-Key"], [], [])),
        (SessionIdHeader(), (["X-Session-ID"], [], [])),
        (
            IdentityHeaders(IdentityHeaders.Options(session="A,B", parent="P", root="R")),
            (["A", "B"], ["P"], ["R"]),
        ),
    ]
    for mode, tiers in modes:
        for ctx in (root_ctx(), child_ctx(final=True)):
            want = reference_stamp(tiers, ctx.session_id, ctx.parent_session_id, ROOT)
            assert list(mode.headers(ctx).items()) == want
            for impl in IMPLS:
                stamped = impl.HeaderStamper(*tiers).stamp(
                    ctx.session_id, ctx.parent_session_id, ctx.root_session_id
                )
                assert list(stamped.items()) == want


# --- nvext_session_control -----------------------------------------------------------------


texts = st.text(max_size=10) | st.sampled_from(["", "café", "日本語", "😀", 'q"\\/', "\x00\n\t"])
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | texts
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.lists(st.tuples(texts, inner), max_size=3).map(Obj)
    ),
    max_leaves=8,
)
MODE_KEYS = ["session_id", "action", "timeout"]
extra_keys = st.sampled_from(["model", "messages", "annotations", "extra"]) | texts


@st.composite
def members_with(draw: st.DrawFn, name: str, named: st.SearchStrategy[Any]) -> Obj:
    """An object with 0-3 random members and 0-2 members `name` (a duplicate when 2)."""
    pairs = [(draw(extra_keys), draw(values)) for _ in range(draw(st.integers(0, 3)))]
    for _ in range(draw(st.integers(0, 2))):
        pairs.insert(draw(st.integers(0, len(pairs))), (name, draw(named)))
    return Obj(pairs)


# session_control: the mode's keys (duplicates too) among others.
control_objects = st.lists(
    st.tuples(st.sampled_from([*MODE_KEYS, "extra", "k"]), values), max_size=6
).map(Obj)
control_values = st.one_of(control_objects, control_objects, values)
nvext_values = st.one_of(*[members_with("session_control", control_values)] * 3, values)


@st.composite
def bodies(draw: st.DrawFn) -> tuple[bytes, Any]:
    """A request body (written with random spelling) and what json.loads gives for it."""
    doc = draw(members_with("nvext", nvext_values))
    writer = Writer(draw(st.randoms(use_true_random=False)), pretty=draw(st.booleans()))
    return writer.document(doc), plain(doc)


def expected(doc: dict[str, Any], sid: str, action: str, timeout: int | None) -> dict[str, Any]:
    """The merge rules of docs/routing.md on a parsed body."""
    nvext = doc.get("nvext")
    nvext = dict(nvext) if isinstance(nvext, dict) else {}
    control = nvext.get("session_control")
    control = dict(control) if isinstance(control, dict) else {}
    control["session_id"] = sid
    control["action"] = action
    if timeout is not None:
        control["timeout"] = timeout
    nvext["session_control"] = control
    return {**doc, "nvext": nvext}


class Pairs(list):  # type: ignore[type-arg]
    """An object parsed with every member kept (object_pairs_hook)."""


def members(obj: Any, key: str) -> list[Any]:
    return [v for k, v in obj if k == key]


def assert_strict(out: bytes, timeout: int | None) -> None:
    """No duplicate key where the mode writes: strict parsers (serde) read the output too."""
    top = json.loads(out, object_pairs_hook=Pairs)
    (nvext,) = members(top, "nvext")
    (control,) = members(nvext, "session_control")
    for key in MODE_KEYS if timeout is not None else MODE_KEYS[:2]:
        assert len(members(control, key)) == 1, key


ids_or_actions = texts | st.sampled_from([ROOT, CHILD, "bind", "close"])
timeouts = st.none() | st.integers(1, 10_000) | st.integers(-(2**70), 2**70)


@SETTINGS
@given(bodies(), ids_or_actions, ids_or_actions, timeouts)
def test_nvext_agrees(body_doc, sid, action, timeout):
    body, doc = body_doc
    r = RUST.nvext_session_control(body, sid, action, timeout)
    p = PY.nvext_session_control(body, sid, action, timeout)
    assert type(r) is bytes and type(p) is bytes
    want = expected(doc, sid, action, timeout)
    assert json.loads(r) == json.loads(p) == want
    assert_strict(r, timeout)
    assert_strict(p, timeout)


plain_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=8,
)
plain_controls = plain_values | st.dictionaries(
    st.sampled_from([*MODE_KEYS, "extra"]) | texts, plain_values, max_size=4
)
plain_nvext = plain_values | st.dictionaries(
    st.sampled_from(["session_control", "annotations"]) | texts, plain_controls, max_size=3
)


@SETTINGS
@given(
    st.dictionaries(extra_keys, plain_values, max_size=4),
    st.none() | plain_nvext,
    ids_or_actions,
    ids_or_actions,
    timeouts,
)
def test_nvext_byte_equal_on_compact_bodies(doc, nvext, sid, action, timeout):
    """A compact body without duplicate keys (what rewrite_request and json.dumps write):
    the splice and the re-serialisation give the same bytes."""
    if nvext is not None:
        doc = {**doc, "nvext": nvext}
    body = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
    r = RUST.nvext_session_control(body, sid, action, timeout)
    assert r == PY.nvext_session_control(body, sid, action, timeout)
    assert json.loads(r) == expected(doc, sid, action, timeout)


@pytest.mark.parametrize(
    ("body", "timeout", "want"),
    [
        (b"{}", 5, b'{"nvext":{"session_control":{"session_id":"s","action":"a","timeout":5}}}'),
        (b" {\n} ", None, b' {"nvext":{"session_control":{"session_id":"s","action":"a"}}\n} '),
        (
            b'{"m":1, "nvext" : [1] }',
            None,
            b'{"m":1, "nvext" : {"session_control":{"session_id":"s","action":"a"}} }',
        ),
        (
            b'{"nvext":{"x":1},"nvext":{"y":2},"m":0}',
            None,
            b'{"nvext":{"y":2,"session_control":{"session_id":"s","action":"a"}},"m":0}',
        ),
        (
            b'{"nvext":{"session_control":{"timeout":9,"action":"x","k":[]}}}',
            None,
            b'{"nvext":{"session_control":{"timeout":9,"k":[],"session_id":"s","action":"a"}}}',
        ),
        (
            b'{"nvext":{"session_control":{"timeout":9,"action":"x","k":[]}}}',
            7,
            b'{"nvext":{"session_control":{"k":[],"session_id":"s","action":"a","timeout":7}}}',
        ),
        (
            b'{"nvext":{"session_control":1,"session_control":{"k":2}}}',
            None,
            b'{"nvext":{"session_control":{"k":2,"session_id":"s","action":"a"}}}',
        ),
        (
            b'{"\\u006evext":{"a":1}}',
            None,
            b'{"\\u006evext":{"a":1,"session_control":{"session_id":"s","action":"a"}}}',
        ),
    ],
)
def test_nvext_exact(body, timeout, want):
    assert RUST.nvext_session_control(body, "s", "a", timeout) == want
    assert json.loads(PY.nvext_session_control(body, "s", "a", timeout)) == json.loads(want)


class Seconds(IntEnum):
    MINUTE = 60


def test_nvext_values_like_json_dumps():
    for sid in ['q"\\/\x00\x1f\x7f\u2028é😀', "", CHILD]:
        for timeout in (None, 0, -1, 2**63 - 1, 2**63, -(2**70), Seconds.MINUTE):
            r = RUST.nvext_session_control(b"{}", sid, "bind", timeout)
            assert r == PY.nvext_session_control(b"{}", sid, "bind", timeout)
            control = {"session_id": sid, "action": "bind"}
            if timeout is not None:
                control["timeout"] = int(timeout)
            dumped = json.dumps(control, separators=(",", ":"), ensure_ascii=False)
            assert r == b'{"nvext":{"session_control":' + dumped.encode() + b"}}"
    # Lone surrogates have no UTF-8: written escaped (through the twin), same bytes.
    for sid, action in (("a\ud800", "bind"), ("s", "\udfff")):
        r = RUST.nvext_session_control(b'{"x":"\\ud800"}', sid, action, 1)
        assert r == PY.nvext_session_control(b'{"x":"\\ud800"}', sid, action, 1)
        assert json.loads(r)["nvext"]["session_control"]["session_id"] == sid


def test_nvext_inputs():
    body = b'{"model":"m","nvext":{"keep":true}}'
    want = RUST.nvext_session_control(body, "s", "close", None)
    for impl in IMPLS:
        for variant in (bytearray(body), memoryview(body), memoryview(b"xx" + body)[2:]):
            assert impl.nvext_session_control(variant, "s", "close", None) == want
    # Inputs only json.loads reads (BOM, UTF-16): through the twin, same bytes.
    for odd in (b"\xef\xbb\xbf" + body, body.decode().encode("utf-16")):
        r = RUST.nvext_session_control(odd, "s", "close", None)
        assert r == PY.nvext_session_control(odd, "s", "close", None)
        assert json.loads(r)["nvext"] == {
            "keep": True,
            "session_control": {"session_id": "s", "action": "close"},
        }
    # Bodies large enough to be scanned and copied without the GIL.
    big = json.dumps(
        {"messages": ["x" * 300_000], "nvext": {"a": [1]}}, separators=(",", ":")
    ).encode()
    r = RUST.nvext_session_control(big, "s", "bind", 3)
    assert r == PY.nvext_session_control(big, "s", "bind", 3)


def test_nvext_errors_agree():
    deep = b"[" * 100_000 + b"]" * 100_000
    cases: list[tuple[Any, ...]] = [
        (b"[1]", "s", "a", None),
        (b'"s"', "s", "a", None),
        (b"null", "s", "a", 1),
        (b"1.5", "s", "a", 1),
        (b"{", "s", "a", 1),
        (b"", "s", "a", 1),
        (b'{"a":1} x', "s", "a", 1),
        (b"\xff", "s", "a", 1),
        (b'{"nvext":{"session_control":{"a":}}}', "s", "a", 1),
        (deep, "s", "a", 1),
        ("{}", "s", "a", 1),
        (None, "s", "a", 1),
        (b"{}", 1, "a", 1),
        (b"{}", "s", None, 1),
        (b"{}", "s", "a", True),
        (b"{}", "s", "a", 1.0),
        (b"{}", "s", "a", "300"),
        (b"{}", "s\ud800", "a", "300"),
        (b"[", "s\ud800", "a", 1),
    ]
    for args in cases:
        r = outcome(RUST.nvext_session_control, *args)
        p = outcome(PY.nvext_session_control, *args)
        assert r == p, args[1:]
        assert r[0] == "err"
    assert outcome(RUST.nvext_session_control, b"[1]", "s", "a", None)[1:] == (
        RequestRewriteError,
        "request body must be a JSON object, got array",
    )
    assert outcome(RUST.nvext_session_control, b"{", "s", "a", None)[2].startswith(
        "request body is not valid JSON: Expecting property name"
    )
    assert outcome(RUST.nvext_session_control, b"{}", "s", "a", True)[1:] == (
        TypeError,
        "nvext_session_control() argument 'timeout' must be int or None, not bool",
    )


# --- the dynamo_nvext mode and the session stamper ----------------------------------------------


@SETTINGS
@given(bodies(), st.booleans(), st.integers(1, 10_000), st.booleans())
def test_nvext_mode_bytes_path_matches_the_object_path(body_doc, final, timeout, child):
    body, doc = body_doc
    mode = DynamoNvext(DynamoNvext.Options(timeout_seconds=timeout))
    ctx = child_ctx(final) if child else root_ctx(final)
    assert json.loads(mode.transform_body_bytes(body, ctx)) == mode.transform_body(doc, ctx)


class ObjectOnlyMode(SessionRoutingMode):
    """A third-party style body mode without a bytes path."""

    name = "object_only"
    mutates_body = True

    def headers(self, ctx: RoutingContext) -> dict[str, str]:
        return {}

    def transform_body(self, body: dict[str, Any], ctx: RoutingContext) -> dict[str, Any]:
        return {**body, "tag": ctx.session_id}


def test_session_stamper_bytes_path():
    nvext = SessionStamper(DynamoNvext(DynamoNvext.Options(timeout_seconds=9)))
    assert nvext.mutates_body and nvext.has_bytes_path
    body = b'{"input_ids":[1,2],"nvext":{"annotations":["a"]}}'
    assert nvext.transform_bytes(body, root_ctx()) == (
        b'{"input_ids":[1,2],"nvext":{"annotations":["a"],'
        b'"session_control":{"session_id":"' + ROOT.encode() + b'","action":"bind","timeout":9}}}'
    )
    for mode in (ObjectOnlyMode(), DynamoHeaders()):
        stamper = SessionStamper(mode)
        assert not stamper.has_bytes_path
        assert stamper.transform_bytes(body, root_ctx()) is None

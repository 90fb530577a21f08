"""Exact wire formats of the built-in session routing modes."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from sessiongate.primitives.header_names import is_token, split_header_names, validate_header_name
from sessiongate.session_routing import (
    BUILTIN_MODES,
    DynamoHeaders,
    DynamoNvext,
    IdentityHeaders,
    RoutingContext,
    SessionIdHeader,
    SmgRoutingKey,
    check_mode_class,
)

ROOT = "0123456789abcdef0123456789abcdef"
CHILD = f"{ROOT}.fedcba9876543210fedcba9876543210"


def root_ctx(final: bool = False) -> RoutingContext:
    return RoutingContext(ROOT, None, ROOT, is_final_turn=final)


def child_ctx(final: bool = False) -> RoutingContext:
    return RoutingContext(CHILD, ROOT, ROOT, is_final_turn=final, is_parent_final=False)


def test_builtin_names_and_contracts():
    assert list(BUILTIN_MODES) == [
        "dynamo_headers",
        "dynamo_nvext",
        "smg_routing_key",
        "session_id_header",
        "identity_headers",
    ]
    for name, cls in BUILTIN_MODES.items():
        assert check_mode_class(cls, expected_name=name) is cls
    assert [n for n, c in BUILTIN_MODES.items() if c.mutates_body] == ["dynamo_nvext"]


def test_context_is_frozen_and_for_root():
    ctx = RoutingContext.for_root(ROOT, is_final_turn=True)
    assert ctx == RoutingContext(ROOT, None, ROOT, True, None, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.session_id = "x"  # type: ignore[misc]


# -- header modes --------------------------------------------------------------------------


def test_dynamo_headers_root_and_child():
    mode = DynamoHeaders()
    assert mode.headers(root_ctx()) == {"X-Dynamo-Session-ID": ROOT}
    assert mode.headers(child_ctx(final=True)) == {
        "X-Dynamo-Session-ID": CHILD,
        "X-Dynamo-Parent-Session-ID": ROOT,
    }


def test_smg_routing_key():
    mode = SmgRoutingKey()
    assert mode.headers(root_ctx()) == {"X-SMG-Routing-Key": ROOT}
    assert mode.headers(child_ctx()) == {"X-SMG-Routing-Key": CHILD}


def test_session_id_header_default_and_custom():
    assert SessionIdHeader().headers(root_ctx()) == {"X-Session-ID": ROOT}
    mode = SessionIdHeader(SessionIdHeader.Options(header_name="  x-affinity "))
    assert mode.headers(child_ctx()) == {"x-affinity": CHILD}  # kept as given, stripped


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("X Session", "not an RFC 9110 token"),
        ("X-Session:", "not an RFC 9110 token"),
        ("Sessión", "not an RFC 9110 token"),
        ("", "header name is empty"),
        ("Content-Length", "set by the gateway itself"),
        ("host", "set by the gateway itself"),
    ],
)
def test_session_id_header_rejects_bad_names(name, fragment):
    with pytest.raises(ValidationError, match=fragment):
        SessionIdHeader.Options(header_name=name)


def test_identity_headers_all_tiers():
    opts = IdentityHeaders.Options(
        session=" X-Session-ID , X-SMG-Routing-Key", parent="X-Parent", root=["X-Root"]
    )
    assert opts.session == ("X-Session-ID", "X-SMG-Routing-Key")
    assert opts.parent == ("X-Parent",)
    assert opts.root == ("X-Root",)
    mode = IdentityHeaders(opts)
    assert mode.headers(root_ctx()) == {
        "X-Session-ID": ROOT,
        "X-SMG-Routing-Key": ROOT,
        "X-Root": ROOT,
    }
    assert mode.headers(child_ctx()) == {
        "X-Session-ID": CHILD,
        "X-SMG-Routing-Key": CHILD,
        "X-Parent": ROOT,
        "X-Root": ROOT,
    }


def test_identity_headers_single_tier_and_empty_tiers():
    mode = IdentityHeaders(IdentityHeaders.Options(root="X-Tree", session=""))
    assert mode.headers(child_ctx()) == {"X-Tree": ROOT}
    parent_only = IdentityHeaders(IdentityHeaders.Options(parent="X-Parent"))
    assert parent_only.headers(root_ctx()) == {}
    assert parent_only.headers(child_ctx()) == {"X-Parent": ROOT}


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({}, "needs at least one header name"),
        ({"session": "", "root": " "}, "needs at least one header name"),
        ({"session": "X-A", "root": "x-a"}, "'x-a' appears in session and root"),
        ({"session": "X-A,x-A"}, "'x-A' appears twice in session"),
        ({"parent": "X-P", "root": ["X-R", "X-P"]}, "'X-P' appears in parent and root"),
        ({"session": "X-A,,X-B"}, "empty header name"),
        ({"session": "X-A,"}, "empty header name"),
        ({"session": "X A"}, "not an RFC 9110 token"),
        ({"root": ["X-R", 3]}, "header names must be strings"),
        ({"session": "Transfer-Encoding"}, "set by the gateway itself"),
        ({"sessions": "X-A"}, "Extra inputs are not permitted"),
    ],
)
def test_identity_headers_validation(kwargs, fragment):
    with pytest.raises(ValidationError, match=fragment):
        IdentityHeaders.Options(**kwargs)


def test_options_are_frozen_and_hashable():
    opts = IdentityHeaders.Options(session="X-A")
    with pytest.raises(ValidationError):
        opts.session = ("X-B",)  # type: ignore[misc]
    assert hash(opts) == hash(IdentityHeaders.Options(session=["X-A"]))


def test_headers_return_a_fresh_dict_each_call():
    for mode in (
        DynamoHeaders(),
        SmgRoutingKey(),
        SessionIdHeader(),
        IdentityHeaders(IdentityHeaders.Options(session="X-A")),
    ):
        first = mode.headers(root_ctx())
        first["X-Injected"] = "1"
        assert "X-Injected" not in mode.headers(root_ctx())


def test_header_modes_leave_the_body_alone():
    body = {"messages": [], "nvext": {"a": 1}}
    for cls in (DynamoHeaders, SmgRoutingKey, SessionIdHeader):
        assert cls.mutates_body is False
        assert cls().transform_body(body, root_ctx()) is body
    assert DynamoNvext().headers(root_ctx()) == {}


# -- dynamo_nvext ---------------------------------------------------------------------------


def test_nvext_bind_then_close_lifecycle():
    mode = DynamoNvext()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    turns = [mode.transform_body(body, root_ctx(final=f)) for f in (False, False, True)]
    assert [t["nvext"] for t in turns] == [
        {"session_control": {"session_id": ROOT, "action": "bind", "timeout": 300}},
        {"session_control": {"session_id": ROOT, "action": "bind", "timeout": 300}},
        {"session_control": {"session_id": ROOT, "action": "close"}},
    ]
    assert all(t["model"] == "m" and t["messages"] == body["messages"] for t in turns)
    assert body == {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_nvext_custom_timeout_and_child_id():
    mode = DynamoNvext(DynamoNvext.Options(timeout_seconds="42"))  # type: ignore[arg-type]
    out = mode.transform_body({}, child_ctx())
    assert out == {
        "nvext": {"session_control": {"session_id": CHILD, "action": "bind", "timeout": 42}}
    }


@pytest.mark.parametrize("bad", [0, -5, "abc", 1.5])
def test_nvext_timeout_validation(bad):
    with pytest.raises(ValidationError):
        DynamoNvext.Options(timeout_seconds=bad)


def test_nvext_merges_without_mutating_the_caller():
    control = {"session_id": "client-chosen", "action": "open", "timeout": 1, "extra": "kept"}
    nvext = {"session_control": control, "annotations": ["a"], "greed_sampling": True}
    body = {"messages": [{"role": "user", "content": "x"}], "nvext": nvext}
    snapshot = copy.deepcopy(body)

    out = DynamoNvext(DynamoNvext.Options(timeout_seconds=7)).transform_body(body, root_ctx())

    assert body == snapshot
    assert body["nvext"] is nvext and nvext["session_control"] is control
    assert out is not body and out["nvext"] is not nvext
    assert out["nvext"]["session_control"] is not control
    assert out["nvext"] == {
        "session_control": {"session_id": ROOT, "action": "bind", "timeout": 7, "extra": "kept"},
        "annotations": ["a"],
        "greed_sampling": True,
    }

    closed = DynamoNvext().transform_body(body, root_ctx(final=True))
    # On close the mode writes only its own keys; the caller's other keys survive.
    assert closed["nvext"]["session_control"] == {
        "session_id": ROOT,
        "action": "close",
        "timeout": 1,
        "extra": "kept",
    }
    assert body == snapshot


@pytest.mark.parametrize("nvext", ["str", 3, None, ["session_control"], True])
def test_nvext_non_object_is_replaced(nvext):
    body = {"nvext": nvext}
    out = DynamoNvext().transform_body(body, root_ctx())
    assert out == {
        "nvext": {"session_control": {"session_id": ROOT, "action": "bind", "timeout": 300}}
    }
    assert body == {"nvext": nvext}


@pytest.mark.parametrize("control", ["bind", 1, None, ["x"]])
def test_nvext_non_object_session_control_is_replaced(control):
    body = {"nvext": {"session_control": control, "keep": 1}}
    out = DynamoNvext().transform_body(body, root_ctx(final=True))
    assert out == {"nvext": {"session_control": {"session_id": ROOT, "action": "close"}, "keep": 1}}


def test_nvext_rejects_non_object_bodies():
    with pytest.raises(TypeError, match="JSON object body"):
        DynamoNvext().transform_body([], root_ctx())  # type: ignore[arg-type]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=12,
)
bodies = st.dictionaries(
    st.sampled_from(["messages", "model", "nvext", "x"]), json_values, max_size=4
).flatmap(
    lambda b: st.one_of(
        st.just(b),
        st.builds(
            lambda nv: {**b, "nvext": nv},
            st.dictionaries(st.sampled_from(["session_control", "k"]), json_values, max_size=2),
        ),
    )
)


@settings(max_examples=200, deadline=None)
@given(body=bodies, final=st.booleans(), timeout=st.integers(1, 10_000))
def test_nvext_property_never_mutates_and_always_stamps(body, final, timeout):
    snapshot = copy.deepcopy(body)
    ctx = child_ctx(final=final)
    out = DynamoNvext(DynamoNvext.Options(timeout_seconds=timeout)).transform_body(body, ctx)
    assert body == snapshot
    control = out["nvext"]["session_control"]
    assert control["session_id"] == CHILD
    if final:
        assert control["action"] == "close"
    else:
        assert (control["action"], control["timeout"]) == ("bind", timeout)
    for key, value in body.items():
        if key != "nvext":
            assert out[key] == value
    old_nvext = body.get("nvext")
    if isinstance(old_nvext, dict):
        for key, value in old_nvext.items():
            if key != "session_control":
                assert out["nvext"][key] == value
        old_control = old_nvext.get("session_control")
        if isinstance(old_control, dict):
            for key, value in old_control.items():
                if key not in ("session_id", "action") and (final or key != "timeout"):
                    assert control[key] == value


# -- header name helpers -------------------------------------------------------------------


def test_token_rules():
    assert is_token("X-Dynamo-Session-ID")
    assert is_token("!#$%&'*+-.^_`|~09azAZ")
    for bad in ("", "a b", "a:b", "a\r\nb", 'a"b', "(a)", "a/b", "é"):
        assert not is_token(bad)
    assert validate_header_name("x-ok") == "x-ok"
    assert split_header_names(" a , b ") == ("a", "b")
    assert split_header_names(["a", " b"]) == ("a", "b")
    assert split_header_names("  ") == ()

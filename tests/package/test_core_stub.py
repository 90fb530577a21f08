"""`python/sessiongate/_core.pyi` must describe the compiled module completely and exactly."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import sessiongate._core as core

# The stub beside the installed core (the source tree's under an editable install).
STUB = Path(core.__file__).resolve().parent / "_core.pyi"


def _public(names: object) -> set[str]:
    return {n for n in names if not n.startswith("_")}  # type: ignore[attr-defined]


def _stub_tree() -> ast.Module:
    return ast.parse(STUB.read_text(encoding="utf-8"))


def _defined(body: list[ast.stmt]) -> dict[str, ast.stmt]:
    names: dict[str, ast.stmt] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = node
    return names


def test_stub_declares_exactly_the_module() -> None:
    stub = _public(_defined(_stub_tree().body))
    module = _public(dir(core))
    assert stub - module == set(), "declared in _core.pyi but missing from _core"
    assert module - stub == set(), "exported by _core but missing from _core.pyi"


def _params(node: ast.FunctionDef) -> list[tuple[str, str]]:
    args = node.args
    out = [(a.arg, "POSITIONAL_OR_KEYWORD") for a in args.posonlyargs + args.args]
    out += [(a.arg, "KEYWORD_ONLY") for a in args.kwonlyargs]
    return [p for p in out if p[0] not in ("self", "cls")]


def _runtime_params(obj: object) -> list[tuple[str, str]]:
    sig = inspect.signature(obj)  # type: ignore[arg-type]
    return [(p.name, p.kind.name) for p in sig.parameters.values() if p.name != "self"]


def test_function_signatures_match() -> None:
    for name, node in _defined(_stub_tree().body).items():
        if isinstance(node, ast.FunctionDef) and not name.startswith("_"):
            assert _params(node) == _runtime_params(getattr(core, name)), name


def _stub_class(name: str) -> ast.ClassDef:
    node = _defined(_stub_tree().body)[name]
    assert isinstance(node, ast.ClassDef)
    return node


@pytest.mark.parametrize("cls_name", ["FrameDecoder", "HeaderStamper", "EnginePolicy"])
def test_class_members_match(cls_name: str) -> None:
    node = _stub_class(cls_name)
    members = _defined(node.body)
    cls = getattr(core, cls_name)
    assert _public(members) == _public(dir(cls))
    for name, member in members.items():
        if name.startswith("_"):
            continue
        is_property = isinstance(member, ast.FunctionDef) and any(
            isinstance(d, ast.Name) and d.id == "property" for d in member.decorator_list
        )
        runtime = inspect.getattr_static(cls, name)
        assert is_property == (not callable(runtime)), name
        if isinstance(member, ast.FunctionDef) and not is_property:
            assert _params(member) == _runtime_params(getattr(cls, name)), name
    init = members["__init__"]
    assert isinstance(init, ast.FunctionDef)
    assert _params(init) == _runtime_params(cls)


def test_extracted_reply_members_match() -> None:
    """ExtractedReply (no constructor): the stub's properties are those of the Rust class and
    of the twin, and all of them are properties."""
    from sessiongate.primitives import python

    members = _defined(_stub_class("ExtractedReply").body)
    names = _public(members)
    assert names == _public(dir(core.ExtractedReply)) == _public(dir(python.ExtractedReply))
    for name in names:
        member = members[name]
        assert isinstance(member, ast.FunctionDef), name
        assert any(isinstance(d, ast.Name) and d.id == "property" for d in member.decorator_list)
        assert not callable(inspect.getattr_static(core.ExtractedReply, name)), name


# The compiled front is a server, not a primitive: its Python twin is the Python front itself
# (`--front python`), and `DispatchedRequest` is its request handed to that front's app.
FRONT_NAMES = frozenset({"CompiledFront", "DispatchedRequest"})
# The test hooks (rust/testing.rs), declared under one heading at the end of the stub, have
# no twin in `primitives`: `front_route`'s is `front/routes.py::front_decision`
# (tests/front/test_front_route_twin.py), `front_forwarded_headers`'s is `http/forwarding.py`
# (tests/http/test_forwarding_twin.py), `front_backoff_ms`'s, `FrontCircuitBreaker`'s
# and `FrontHealthCounter`'s are `engines/reliability.py` (tests/primitives/
# test_reliability_twin.py), `reserved_header_names` is compared with
# `primitives/header_names.py`, `json_reject` is the relay scanner's verdict, and the failure
# texts' and `front_retry_target`'s are in `engines/client.py`, `http/client.py` and
# `engines/pool.py` (tests/engines/test_engine_client_twin.py), `front_bulk_pauses`'s is
# `front/cpu_pressure.py` (tests/front/test_cpu_pressure.py), `front_sibling_warmup`'s and
# `front_siblings_roles`'s are `engines/siblings.py` (tests/engines/test_siblings.py).
TEST_HOOKS = frozenset(
    {
        "json_reject",
        "reserved_header_names",
        "front_route",
        "front_forwarded_headers",
        "front_backoff_ms",
        "FrontCircuitBreaker",
        "FrontHealthCounter",
        "front_transport_error_text",
        "front_connect_failed_text",
        "front_connect_timed_out",
        "front_url_hostname",
        "front_retry_target",
        "front_bulk_pauses",
        "front_sibling_warmup",
        "front_siblings_roles",
    }
)
TEST_HOOKS_HEADING = "# Test hooks (rust/testing.rs)"
# `build_info` describes the compiled core itself: it has no twin. `EnginePolicy`'s twin is
# the specification in `sessiongate.engines.policy` (checked below).
NO_TWIN = FRONT_NAMES | TEST_HOOKS | {"build_info", "EnginePolicy"}


def test_test_hooks_are_declared_in_one_place() -> None:
    """Every name after the stub's test-hooks heading is a test hook, and every test hook is
    there."""
    lines = STUB.read_text(encoding="utf-8").splitlines()
    heading = next(i for i, line in enumerate(lines) if line.startswith(TEST_HOOKS_HEADING)) + 1
    after = {n for n, node in _defined(_stub_tree().body).items() if node.lineno > heading}
    assert after == TEST_HOOKS
    assert all(hasattr(core, name) for name in TEST_HOOKS)


def test_python_twins_share_the_signatures() -> None:
    from sessiongate.primitives import python

    for name, node in _defined(_stub_tree().body).items():
        if name.startswith("_") or name in NO_TWIN:
            continue
        assert hasattr(python, name), f"python twin lacks {name}"
        if isinstance(node, ast.FunctionDef):
            assert _params(node) == _runtime_params(getattr(python, name)), name
    for cls_name in ("FrameDecoder", "HeaderStamper"):
        stub_cls = _stub_class(cls_name)
        twin = getattr(python, cls_name)
        assert _public(_defined(stub_cls.body)) == _public(dir(twin)), cls_name
    stamp = _defined(_stub_class("HeaderStamper").body)["stamp"]
    assert isinstance(stamp, ast.FunctionDef)
    assert _params(stamp) == _runtime_params(python.HeaderStamper.stamp)


def test_engine_policy_twin_shares_the_signatures() -> None:
    from sessiongate.engines.policy import PyEnginePolicy

    members = _defined(_stub_class("EnginePolicy").body)
    assert _public(members) == _public(dir(PyEnginePolicy))
    for name, member in members.items():
        if not isinstance(member, ast.FunctionDef) or name.startswith("_"):
            continue
        decorators = member.decorator_list
        if not any(isinstance(d, ast.Name) and d.id == "property" for d in decorators):
            assert _params(member) == _runtime_params(getattr(PyEnginePolicy, name)), name
    init = members["__init__"]
    assert isinstance(init, ast.FunctionDef)
    assert _params(init) == _runtime_params(PyEnginePolicy)

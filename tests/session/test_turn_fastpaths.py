"""The session turn's fast paths give exactly what the slow paths they skip would give.

Each fast path is compared with a reference: the uncached prefix render, the full strict
comparison, the matcher called on every message, the depth walk run on every body, and
jinja's own sandbox attribute lookup.
"""

from __future__ import annotations

import asyncio
import copy
import json
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment

from sessiongate import json_safety
from sessiongate.engines.pool import EnginePool
from sessiongate.errors import BadRequest, GatewayError, TitoMismatch
from sessiongate.json_safety import NotUnicode, TooDeep, loads_checked
from sessiongate.protocol import CoreRequest
from sessiongate.session import messages, tito
from sessiongate.session.core import SessionCore
from sessiongate.session.messages import (
    MATCHERS,
    _empty_as_none,
    _without_wire_keys,
    loose_tool_call_match,
    messages_match,
    plan_history,
    strict_match,
)
from sessiongate.session.settings import SessionSettings
from sessiongate.session.tito import TitoEngine
from sessiongate.session_routing.base import RoutingContext, SessionRoutingMode
from sessiongate.session_routing.stamper import SessionStamper
from sessiongate.tokenizer import ChatTokenizer, load_tokenizer
from sessiongate.tokenizer.template import _ChatTemplateEnvironment, compile_template
from support.procs import ServerProcess, mock_engine

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

TOKENIZER = load_tokenizer(None)
EXAMPLES = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --- JSON values ----------------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-3, 3)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from(["", "a", "1", "[", "{", "\\u", "é"])
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=8,
)


# --- 1. the cached prefix render in TitoEngine.appended_ids ---------------------------------

# Renders the prefix from every input the cache key holds, in type-revealing ways: the kwarg
# `v` printed raw (1, 1.0, True, "1", [1] and (1,) all differ), tools and the stub's tool
# calls as JSON and as Python text. `boom` makes the template refuse (never cached).
PROBE_TEMPLATE = (
    "{%- if boom is defined -%}{{ raise_exception('boom ' ~ boom) }}{%- endif -%}"
    "{%- if v is defined -%}[v={{ v }}|{{ v is sequence }}|{{ v is mapping }}]{%- endif -%}"
    "{%- if tools -%}<tools>{{ tools | tojson }}|{{ tools }}</tools>{%- endif -%}"
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m.role + '\\n' -}}"
    "{%- if m.content is string -%}{{ m.content }}{%- else -%}{{ m.content | tojson }}{%- endif -%}"
    "{%- if m.tool_calls -%}{{ m.tool_calls | tojson }}{{ m.tool_calls }}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def probe_tokenizer(template: str = PROBE_TEMPLATE) -> ChatTokenizer:
    return ChatTokenizer(
        TOKENIZER.backend, chat_template=template, eos_token="<|im_end|>", name_or_path="probe"
    )


def uncached(engine: TitoEngine) -> TitoEngine:
    slow = TitoEngine(engine.tokenizer, chat_template_kwargs=engine.chat_template_kwargs)
    slow._prefix_reusable = False
    return slow


def outcome(engine: TitoEngine, *args: Any) -> tuple[str, Any]:
    try:
        return ("ids", engine.appended_ids(*args))
    except GatewayError as exc:
        return (type(exc).__name__, exc.message)


tool_lists = st.none() | st.lists(
    st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.text()})},
        optional={"extra": json_values},
    ),
    max_size=3,
)
call_lists = st.none() | st.lists(
    st.fixed_dictionaries(
        {"id": st.sampled_from(["c1", "c2"])},
        optional={"function": json_values, "index": st.integers(0, 2)},
    ),
    max_size=2,
)
kwarg_sets = st.none() | st.dictionaries(
    st.sampled_from(["v", "w", "boom", "enable_thinking"]), json_values, max_size=3
)
appended_lists = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "tool", "system"]),
            "content": st.text(max_size=5) | st.none(),
        }
    ),
    min_size=1,
    max_size=2,
)


@EXAMPLES
@given(
    turns=st.lists(
        st.tuples(kwarg_sets, tool_lists, call_lists, appended_lists), min_size=1, max_size=6
    ),
    template=st.sampled_from([PROBE_TEMPLATE, TOKENIZER.chat_template]),
)
def test_cached_prefix_gives_the_uncached_ids_and_errors(
    turns: list[tuple[Any, Any, Any, list[dict[str, Any]]]], template: str
) -> None:
    engine = TitoEngine(probe_tokenizer(template))
    assert engine._prefix_reusable
    slow = uncached(engine)
    # Each turn twice: a miss then a hit, among other keys that must not be confused with it.
    for kwargs, tools, calls, appended in [*turns, *turns]:
        args = ({"role": "assistant", "content": "x", "tool_calls": calls}, appended, tools, kwargs)
        assert outcome(engine, *args) == outcome(slow, *args)


@pytest.mark.parametrize(
    "values",
    [
        [1, 1.0, True, "1", [1], (1,), {"1": 1}, {1: 1}, -0.0, 0.0, 0, False, None, ""],
        [[1, 2], (1, 2), {"a": 1, "b": 2}, {"b": 2, "a": 1}],
    ],
)
def test_prefix_cache_never_confuses_values_that_render_differently(values: list[Any]) -> None:
    engine = TitoEngine(probe_tokenizer())
    slow = uncached(engine)
    last = {"role": "assistant", "content": "x"}
    appended = [{"role": "user", "content": "q"}]
    for value in [*values, *reversed(values)]:
        # In a tool, the value sits where SGLang's tool model keeps any JSON: the parameters.
        tool = {"function": {"name": "f", "parameters": {"v": value}}}
        for kwargs, tools in (({"v": value}, None), (None, [tool])):
            got = engine.appended_ids(last, appended, tools, kwargs)
            assert got == slow.appended_ids(last, appended, tools, kwargs), value


def test_prefix_cache_is_used_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = TitoEngine(TOKENIZER)
    renders: list[int] = []
    real_render = TOKENIZER.render

    def counting(messages: list[dict[str, Any]], **kwargs: Any) -> str:
        renders.append(len(messages))
        return real_render(messages, **kwargs)

    monkeypatch.setattr(engine, "tokenizer", type("T", (), {})())
    engine.tokenizer.render = counting  # type: ignore[attr-defined]
    engine.tokenizer.encode = TOKENIZER.encode  # type: ignore[attr-defined]
    last = {"role": "assistant", "content": "x"}
    for turn in range(3):
        engine.appended_ids(last, [{"role": "user", "content": f"q{turn}"}], None)
    assert renders == [2, 3, 3, 3]  # the prefix (2 messages) once, then the turn only
    monkeypatch.setattr(tito, "_PREFIX_CACHE_BYTES", 4096)
    for n in range(200):
        tools = [{"type": "function", "function": {"name": f"f{n}", "description": "d" * n}}]
        engine.appended_ids(last, [{"role": "user", "content": "q"}], tools)
        assert len(engine._prefix_cache) <= tito._PREFIX_CACHE_SIZE
        assert engine._prefix_cache_bytes <= 4096
        assert engine._prefix_cache_bytes == sum(
            len(k) + len(v) for k, v in engine._prefix_cache.items()
        )


def test_a_refused_prefix_is_not_cached() -> None:
    engine = TitoEngine(probe_tokenizer())
    last = {"role": "assistant", "content": "x"}
    appended = [{"role": "user", "content": "q"}]
    for _ in range(2):
        with pytest.raises(BadRequest, match=r"could not render the new messages.*boom 1"):
            engine.appended_ids(last, appended, None, {"boom": 1})
    assert engine._prefix_cache == {}
    with pytest.raises(BadRequest, match="field 'tools' must be a list"):
        engine.appended_ids(last, appended, "tools", None)
    assert engine._prefix_cache == {}


class Text(str):
    pass


def test_values_marshal_cannot_key_are_rendered_every_time() -> None:
    engine = TitoEngine(probe_tokenizer())
    slow = uncached(engine)
    last = {"role": "assistant", "content": "x"}
    appended = [{"role": "user", "content": "q"}]
    for kwargs in ({"v": Text("a")}, {"v": OrderedDict(a=1)}, {"v": object()}):
        assert engine.appended_ids(last, appended, None, kwargs) == slow.appended_ids(
            last, appended, None, kwargs
        )
    assert engine._prefix_cache == {}


@pytest.mark.parametrize(
    ("template", "deterministic"),
    [
        ("{{ messages }}", True),
        ("{{ strftime_now('%Y') }}{{ messages }}", False),
        ("{% if strftime_now is defined %}{% set d = strftime_now %}{% endif %}", False),
        ("{{ lipsum(1) }}", False),
        ("{{ messages | random }}", False),
        ("{% filter random %}ab{% endfilter %}", False),
        ("{{ range(3) | list }}{{ namespace(a=1).a }}{{ raise_exception is defined }}", True),
    ],
)
def test_templates_using_the_clock_or_randomness_are_never_reused(
    template: str, deterministic: bool
) -> None:
    assert compile_template(template, "t").deterministic is deterministic
    tok = probe_tokenizer(template + PROBE_TEMPLATE)
    assert tok.renders_deterministically is deterministic
    assert TitoEngine(tok)._prefix_reusable is deterministic
    assert TOKENIZER.renders_deterministically


def test_empty_kwargs_key_is_the_json_text() -> None:
    assert tito._kwargs_key({}) == json.dumps({}, sort_keys=True, separators=(",", ":"))


def check_extends_reference(
    engine: TitoEngine, previous: Any, new: Any, session_id: str
) -> tuple[str, str]:
    """check_extends before `_as_list`: both heads copied with list()."""
    check_len = len(previous) - engine.max_trim_tokens
    if check_len <= 0:
        return ("ok", "")
    head_new, head_prev = new[:check_len], previous[:check_len]
    if list(head_new) == list(head_prev):
        return ("ok", "")
    first = next(
        (i for i, (a, b) in enumerate(zip(head_new, head_prev, strict=False)) if a != b),
        min(len(new), check_len),
    )
    return (
        "TitoMismatch",
        f"session {session_id}: TITO prefix mismatch: the stored {len(previous)} tokens "
        f"(checking the first {check_len}, allowing {engine.max_trim_tokens} trailing) are "
        f"not a prefix of the new {len(new)} prompt+completion tokens; first difference "
        f"at index {first}",
    )


@EXAMPLES
@given(
    previous=st.lists(st.integers(0, 5), max_size=12),
    tail=st.lists(st.integers(0, 5), max_size=4),
    edit=st.none() | st.tuples(st.integers(0, 11), st.integers(0, 5)),
    trim=st.integers(0, 3),
    kind=st.sampled_from(["q", "i", "list", "tuple"]),
)
def test_check_extends_answers_as_with_list_copies(
    previous: list[int], tail: list[int], edit: Any, trim: int, kind: str
) -> None:
    new = [*previous, *tail]
    if edit is not None and edit[0] < len(new):
        new[edit[0]] = edit[1]
    stored: Any = {"list": list, "tuple": tuple}.get(kind, lambda ids: array(kind, ids))(previous)
    engine = TitoEngine(TOKENIZER, max_trim_tokens=trim)
    try:
        engine.check_extends(stored, new, "s")
        got = ("ok", "")
    except TitoMismatch as exc:
        got = ("TitoMismatch", exc.message)
    assert got == check_extends_reference(engine, stored, new, "s")
    assert tito._as_list(stored) == list(stored)


# --- 2. strict_match and plan_history -------------------------------------------------------


def strict_reference(stored: dict[str, Any], replayed: dict[str, Any]) -> bool:
    """strict_match before its fast paths."""
    for key in messages._TEMPLATE_KEYS:
        left, right = _empty_as_none(stored.get(key)), _empty_as_none(replayed.get(key))
        if key == "tool_calls":
            left, right = _without_wire_keys(left), _without_wire_keys(right)
        # Compared as the framework's dict `==` compares values: identity first, so one NaN
        # object equals itself (a bare `nan != nan` is True).
        if [left] != [right]:
            return False
    return True


empties = st.sampled_from([None, "", []])
calls = st.lists(
    st.fixed_dictionaries(
        {"id": st.sampled_from(["c1", "c2"]), "type": st.just("function")},
        optional={
            "index": st.integers(0, 2),
            "function": st.fixed_dictionaries(
                {
                    "name": st.sampled_from(["f", "g"]),
                    "arguments": st.sampled_from(['{"a": 1}', '{"a":1}', "{}", ""]) | json_values,
                }
            ),
        },
    ),
    max_size=2,
)
message_values = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool"])},
    optional={
        "content": st.sampled_from(["hi", "hi ", "ok"]) | empties | json_values,
        "reasoning_content": st.sampled_from(["r", "s"]) | empties,
        "tool_calls": calls | empties,
        "name": st.sampled_from(["n", None]),
        "tool_call_id": st.sampled_from(["c1", "c2"]),
        "refusal": st.none(),
    },
)


def edited(draw: st.DrawFn, message: dict[str, Any]) -> dict[str, Any]:
    """An echo of `message`: a deep copy, edited or not (a null field added, a field
    emptied or dropped, a value replaced, call indexes dropped)."""
    echo = copy.deepcopy(message)
    for _ in range(draw(st.integers(0, 2))):
        key = draw(st.sampled_from(["content", "reasoning_content", "tool_calls", "refusal"]))
        edit = draw(st.sampled_from(["null", "empty", "drop", "replace", "unindex"]))
        if edit == "null":
            echo.setdefault(key, None)
        elif edit == "empty":
            echo[key] = draw(empties)
        elif edit == "drop":
            echo.pop(key, None)
        elif edit == "replace":
            echo[key] = draw(json_values)
        elif isinstance(echo.get("tool_calls"), list):
            for call in echo["tool_calls"]:
                if isinstance(call, dict):
                    call.pop("index", None)
    return echo


@st.composite
def message_pairs(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, Any]]:
    """A message and an echo of it, or an unrelated message."""
    stored = draw(message_values)
    return stored, draw(message_values) if draw(st.booleans()) else edited(draw, stored)


@EXAMPLES
@given(pair=message_pairs())
def test_strict_match_fast_paths_agree_with_the_full_comparison(
    pair: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    stored, replayed = pair
    expected = strict_reference(stored, replayed)
    assert strict_match(stored, replayed) is expected
    assert strict_match(stored, stored) is strict_reference(stored, stored)
    # The matcher built on it keeps its answers too.
    assert loose_tool_call_match(stored, replayed) is loose_reference(stored, replayed)


def loose_reference(stored: dict[str, Any], replayed: dict[str, Any]) -> bool:
    # loose_tool_call_match with strict_match's answer replaced by the reference's.
    original = messages.strict_match
    try:
        messages.strict_match = strict_reference  # type: ignore[assignment]
        return messages.loose_tool_call_match(stored, replayed)
    finally:
        messages.strict_match = original


def test_strict_match_is_exact_on_the_usual_echo() -> None:
    stored = {"role": "assistant", "content": "who"}  # as parse_reply stores it
    echo = {"role": "assistant", "content": "who", "reasoning_content": None}
    assert strict_match(stored, echo) and strict_reference(stored, echo)
    echo["reasoning_content"] = "think"
    assert not strict_match(stored, echo) and not strict_reference(stored, echo)


@st.composite
def histories(draw: st.DrawFn) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A stored history (user / assistant / tool turns) and a request replaying it with
    some echoes edited, cut short or extended."""
    stored = [{"role": "user", "content": "start"}]
    for turn in range(draw(st.integers(0, 4))):
        assistant = draw(message_values)
        assistant["role"] = "assistant"
        stored += [assistant, {"role": draw(st.sampled_from(["tool", "user"])), "content": turn}]
    requested = [edited(draw, message) for message in stored]
    requested = requested[: draw(st.integers(0, len(requested)))]
    requested += [{"role": "tool", "content": "new"}] * draw(st.integers(0, 2))
    return stored, requested


def plan_outcome(
    stored: list[dict[str, Any]], requested: list[dict[str, Any]], matcher: Any
) -> tuple[str, Any]:
    try:
        plan = plan_history(
            stored,
            requested,
            session_id="s",
            allowed_roles=frozenset({"tool", "user"}),
            matcher=matcher,
        )
    except BadRequest as exc:
        return ("BadRequest", exc.message)
    return ("plan", plan)


@EXAMPLES
@given(history=histories(), name=st.sampled_from(sorted(MATCHERS)))
def test_plan_history_equals_calling_the_matcher_on_every_message(
    history: tuple[list[dict[str, Any]], list[dict[str, Any]]], name: str
) -> None:
    stored, requested = history
    matcher = MATCHERS[name]
    # A wrapper is not a known matcher: plan_history calls it for every message.
    expected = plan_outcome(stored, requested, lambda s, r: matcher(s, r))
    assert plan_outcome(stored, requested, matcher) == expected
    assert plan_outcome(stored, requested, name) == expected
    if matcher is strict_match:
        assert plan_outcome(stored, requested, strict_reference) == expected


def test_canonical_matcher_is_not_assumed_to_accept_equal_messages() -> None:
    # It re-parses tool-call arguments: a deeply nested arguments string raises even when the
    # messages are equal, so equal messages still go through it (and raise as before).
    message = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "f", "arguments": "[" * 100_000}}],
    }
    assert not any(messages_match is known for known in messages._ACCEPT_EQUAL)
    stored = [{"role": "user", "content": "q"}, message]
    requested = [*copy.deepcopy(stored), {"role": "tool", "content": "r"}]
    with pytest.raises(RecursionError):
        plan_outcome(stored, requested, messages_match)
    with pytest.raises(RecursionError):
        plan_outcome(stored, requested, None)
    # The fast path's own comparison falls back (to the matcher) instead of raising.
    left: list[Any] = []
    right: list[Any] = []
    for _ in range(100_000):
        left, right = [left], [right]
    assert messages._equal(left, right) is False


# --- 3. loads_checked ------------------------------------------------------------------------


def loads_reference(body: bytes, limit: int) -> Any:
    """loads_checked before the bracket count: the depth walk always runs."""
    try:
        document = json.loads(body)
    except RecursionError as exc:
        raise TooDeep(f"nested more than {limit} levels deep") from exc
    data = bytes(body)
    strings = (
        (b"\\" in data and json_safety._SURROGATE_ESCAPE.search(data) is not None)
        or b"\xed" in data
        or json.detect_encoding(data) not in ("utf-8", "utf-8-sig")
    )
    problem = json_safety._scan(document, limit, strings=strings)
    if problem == "deep":
        raise TooDeep(f"nested more than {limit} levels deep")
    if problem == "unicode":
        raise NotUnicode(json_safety.find_unencodable(document) or "a string")
    return document


def loads_outcome(load: Any, body: bytes, limit: int) -> tuple[str, Any]:
    try:
        document = load(body, limit)
    except ValueError as exc:
        return (type(exc).__name__, str(exc))
    return ("ok", json.dumps(document, sort_keys=True, default=repr))


def nested(depth: int, leaf: str) -> str:
    return (
        "".join(("[", '{"k":')[i % 2] for i in range(depth))
        + leaf
        + "".join(("]", "}")[i % 2] for i in reversed(range(depth)))
    )


@EXAMPLES
@given(
    value=json_values,
    depth=st.integers(0, 8),
    leaf=st.sampled_from(['"x"', '"\\ud800"', '"[{"', '"\\ud83d\\ude00"', "1", "[]"]),
    limit=st.integers(-1, 9),
    encoding=st.sampled_from(["utf-8", "utf-8-sig", "utf-16"]),
)
def test_loads_checked_refuses_exactly_what_the_depth_walk_refuses(
    value: Any, depth: int, leaf: str, limit: int, encoding: str
) -> None:
    text = json.dumps({"v": value, "n": json.loads(nested(depth, leaf))})
    bodies = [
        text.encode(encoding, "surrogatepass"),
        json.dumps(value).encode(),
        nested(depth, leaf).encode(),
        nested(depth, leaf).encode()[:-1],  # invalid JSON
    ]
    for body in bodies:
        expected = loads_outcome(loads_reference, body, limit)
        assert loads_outcome(loads_checked, body, limit) == expected


@pytest.mark.parametrize("limit", [0, 1, 2, 5, json_safety.MAX_JSON_DEPTH])
def test_bracket_count_boundary(limit: int) -> None:
    for depth in range(max(0, limit - 1), limit + 3):
        for leaf in ('"a"', '"[[[["', '"\\ud800"'):
            body = nested(depth, leaf).encode()
            expected = loads_outcome(loads_reference, body, limit)
            assert loads_outcome(loads_checked, body, limit) == expected
            if leaf == '"a"':
                assert (expected[0] == "TooDeep") is (depth > limit)


# --- 4. the sandbox's attribute lookup on plain dicts ----------------------------------------

SANDBOX = ImmutableSandboxedEnvironment()
FAST_ENV = _ChatTemplateEnvironment()
attribute_names = st.sampled_from(
    ["role", "content", "items", "get", "keys", "pop", "update", "__class__", "__len__", "x"]
) | st.text(max_size=4)


def lookup(env: ImmutableSandboxedEnvironment, obj: Any, name: str) -> tuple[Any, ...]:
    value = env.getattr(obj, name)
    if isinstance(value, env.undefined):
        # Undefined objects compare by kind, name, object and hint.
        return ("undefined", type(value), value._undefined_name, value._undefined_obj is obj,
                value._undefined_hint, value._undefined_exception)  # fmt: skip
    if callable(value) and hasattr(value, "__self__"):
        return ("method", value.__self__ is obj, value.__name__)
    return ("value", value)


@EXAMPLES
@given(
    obj=st.dictionaries(attribute_names, scalars, max_size=4)
    | json_values
    | st.builds(OrderedDict, st.dictionaries(attribute_names, scalars, max_size=2)),
    name=attribute_names,
)
def test_dict_attribute_shortcut_matches_the_sandbox(obj: Any, name: str) -> None:
    # Tuples compare items by identity first: a NaN found in `obj` equals itself.
    assert lookup(FAST_ENV, obj, name) == lookup(SANDBOX, obj, name)


@EXAMPLES
@given(
    message=st.dictionaries(attribute_names, scalars, max_size=4),
    name=attribute_names,
)
def test_templates_render_the_same_with_the_shortcut(message: dict[str, Any], name: str) -> None:
    source = (
        "{{ m.role }}|{{ m.content is defined }}|{{ m.missing }}|{{ m.keys() | list }}|"
        "{{ m.get('role') }}|{{ m.items() | list }}|{{ m[name] is defined }}|"
        "{{ m | attr(name) is defined }}|{{ m.update is defined }}"
    )
    variables = {"m": message, "name": name}
    try:
        expected: Any = SANDBOX.from_string(source).render(**variables)
    except Exception as exc:  # the sandbox refuses: so must the shortcut, alike
        expected = (type(exc), str(exc))
    try:
        got: Any = FAST_ENV.from_string(source).render(**variables)
    except Exception as exc:
        got = (type(exc), str(exc))
    assert got == expected


# --- token ids as int64 arrays through a whole turn -----------------------------------------


class _TagMode(SessionRoutingMode):
    """A body-rewriting mode without a bytes path: it sees the parsed body, re-serialised."""

    name = "tag_for_test"
    mutates_body = True
    seen: list[object] = []

    def headers(self, ctx: RoutingContext) -> dict[str, str]:
        return {}

    def transform_body(self, body: dict[str, Any], ctx: RoutingContext) -> dict[str, Any]:
        self.seen.append(body["input_ids"])
        return {**body, "tag": ctx.session_id}


@pytest.fixture(scope="module")
def engine() -> Iterator[ServerProcess]:
    with mock_engine("--completion-tokens", "5") as proc:
        yield proc


@pytest.mark.parametrize("mode", [None, "object"])
def test_turn_ids_reach_the_engine_and_the_record_exactly(
    engine: ServerProcess, mode: str | None
) -> None:
    # The prompt and checkpoint ids are int64 arrays (session/core.py); the upstream body,
    # the record and a body-rewriting mode must see exactly the ids a list would give.
    tag = _TagMode() if mode else None
    stamper = SessionStamper(tag) if tag else None
    core = SessionCore(TOKENIZER, EnginePool([engine.url], timeout=30), SessionSettings(), stamper)
    loop = asyncio.new_event_loop()
    try:
        history: list[dict[str, Any]] = [{"role": "user", "content": "a long task " * 200}]
        previous: list[int] = []
        for turn in range(4):
            body = json.dumps({"model": "m", "messages": history, "max_tokens": 5}).encode()
            request = CoreRequest(
                op="chat",
                session_id="ids",
                path="/v1/chat/completions",
                method="POST",
                headers=[],
                body=body,
                auto_create=True,
            )
            reply = loop.run_until_complete(core.handle(request))
            assert reply.status == 200, reply.body
            session = core.sessions["ids"]
            record = session.records[-1]
            sent = json.loads(record.request)
            checkpoint = session.accumulated_ids.tolist()
            assert sent["input_ids"] == checkpoint[: record.prompt_len]
            assert checkpoint[record.prompt_len :] == record.completion_ids.tolist()
            assert checkpoint[: len(previous)] == previous
            if tag is not None:
                assert type(tag.seen[-1]) is list and tag.seen[-1] == sent["input_ids"]
                assert sent["tag"] == "ids"
            previous = checkpoint
            history += [json.loads(reply.body)["choices"][0]["message"]]
            history += [{"role": "user", "content": f"step {turn}"}]
        # Token-exact against one render of the whole conversation.
        assert core.tito.mismatches(session.messages, None, session.accumulated_ids) == []
    finally:
        loop.run_until_complete(core.aclose())
        # Background work still running (aclose ends the core's own memory trims); gather()
        # of nothing would ask the policy for a loop, which an earlier test may have unset.
        if pending := asyncio.all_tasks(loop):
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()

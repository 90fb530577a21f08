"""JSON relay primitives: extract_reply, rewrite_request, decode_r3 (docs/relay.md).

The Rust core and the pure-Python twin must agree: same fields, client bodies that parse
equal, same exception classes and messages. Generated replies vary member order, escapes,
whitespace, number forms, duplicate keys, nesting and the number of choices.
"""

from __future__ import annotations

import base64
import json
import random
import string
import sys
import threading
from array import array
from collections.abc import Callable
from enum import IntEnum
from typing import Any

import pytest
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

import sessiongate._core as core
from sessiongate.errors import UpstreamError
from sessiongate.primitives import errors, get_impl
from sessiongate.primitives.errors import ReplyContractError, RequestRewriteError
from sessiongate.session.reply import parse_reply
from support.json_models import Obj, Writer, plain

RUST = get_impl("rust")
PY = get_impl("python")
FIELDS = (
    "completion_ids",
    "logprobs",
    "completion_tokens",
    "finish_reason",
    "message",
    "routed_experts",
    "prompt_tokens",
    "indexer_topk",
    "cached_tokens",
    "weight_version",
    "e2e_latency",
)
R3_KEYS = ("routed_experts", "indexer_topk")
PREFIX = "upstream reply breaks the chat contract: "


def outcome(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, ...]:
    try:
        return ("ok", fn(*args, **kwargs))
    except Exception as exc:
        return ("err", type(exc), str(exc))


def fields_of(reply: Any) -> dict[str, Any]:
    return {name: getattr(reply, name) for name in FIELDS}


def assert_same_reply(body: Any) -> Any:
    """Both twins accept `body` with equal fields and parse-equal client bodies."""
    r, p = RUST.extract_reply(body), PY.extract_reply(body)
    assert type(r.client_body) is bytes and type(p.client_body) is bytes
    assert fields_of(r) == fields_of(p)
    assert json.loads(r.client_body) == json.loads(p.client_body)
    assert repr(r) == repr(p)
    for reply_ in (r, p):
        for name in ("routed_experts", "indexer_topk"):
            view, text = getattr(reply_, name + "_view"), getattr(p, name)
            assert (view is None) == (text is None)
            if view is not None:
                assert view.readonly and view.format == "B" and view.tobytes() == text
    return r


def assert_same_error(body: Any) -> tuple[Any, ...]:
    r, p = outcome(RUST.extract_reply, body), outcome(PY.extract_reply, body)
    assert r[0] == "err" and p[0] == "err", (r, p)
    assert r == p
    return r


def stripped(doc: Any) -> Any:
    """The client view of a parsed reply (independent of both implementations)."""
    if isinstance(doc, dict) and isinstance(doc.get("choices"), list):
        choices = []
        for choice in doc["choices"]:
            if isinstance(choice, dict) and isinstance(choice.get("meta_info"), dict):
                meta = {k: v for k, v in choice["meta_info"].items() if k not in R3_KEYS}
                choice = {**choice, "meta_info": meta}
            choices.append(choice)
        doc = {**doc, "choices": choices}
    return doc


# --- strategies -------------------------------------------------------------------------------

texts = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12
) | st.sampled_from(["", "café", "日本語", "😀 emoji", 'quote " back \\ slash /', "\x00\x1f\n\t"])
finite = st.floats(allow_nan=False, allow_infinity=False)
scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | finite | texts
keys = texts | st.sampled_from(["routed_experts", "indexer_topk", "meta_info", "choices"])
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.lists(st.tuples(keys, inner), max_size=4).map(Obj)
    ),
    max_leaves=12,
)
b64 = st.binary(max_size=96).map(lambda b: base64.b64encode(b).decode())


@st.composite
def entries(draw: st.DrawFn) -> list[Any]:
    n = draw(st.integers(0, 12))
    out = []
    for _ in range(n):
        lp = draw(
            st.floats(max_value=0.0, allow_nan=False, allow_infinity=False)
            | st.integers(-5, 0)
            | st.sampled_from([True, False, -0.0, float("-inf")])
        )
        token = draw(st.integers(0, 2**63 - 1) | st.integers(0, 200_000))
        # SGLang writes [logprob, token_id, text]; text may be null.
        tail = draw(st.sampled_from([[], [None], [None, "x"], ["tok"], ["", 1]]))
        out.append([lp, token, *tail])
    return out


@st.composite
def metas(draw: st.DrawFn) -> Obj:
    items = draw(entries())
    pairs: list[tuple[str, Any]] = [
        ("output_token_logprobs", items),
        ("completion_tokens", len(items)),
    ]
    if draw(st.booleans()):
        pairs.append(("prompt_tokens", draw(st.integers(0, 10**6) | st.none() | texts)))
    if draw(st.booleans()):
        reason = Obj([("type", "stop"), ("matched", draw(st.integers(0, 10**5)))])
        pairs.append(("finish_reason", draw(st.sampled_from(["length", None]) | st.just(reason))))
    if draw(st.booleans()):
        pairs.append(("routed_experts", draw(b64 | st.none())))
    if draw(st.booleans()):
        pairs.append(("indexer_topk", draw(b64 | st.none())))
    if draw(st.booleans()):
        pairs.append(("cached_tokens", draw(st.integers(0, 10**6) | st.none() | st.booleans())))
    if draw(st.booleans()):
        pairs.append(("weight_version", draw(texts | st.none() | values)))
    if draw(st.booleans()):
        latency = finite | st.integers(-(2**1100), 2**1100) | st.sampled_from([1e400, -1e400])
        pairs.append(("e2e_latency", draw(latency | st.none() | st.booleans() | values)))
    if draw(st.booleans()):
        # A nested object with the same names: not a member of meta_info, so it stays.
        inner = Obj([("routed_experts", "keep"), ("meta_info", Obj([("indexer_topk", 1)]))])
        pairs.append(("nested", inner))
    pairs += draw(st.lists(st.tuples(texts, values), max_size=3))
    draw(st.randoms(use_true_random=False)).shuffle(pairs)
    if draw(st.integers(0, 4)) == 0:
        # Duplicates: a decoy first (the last one wins), or R3 twice.
        name = draw(
            st.sampled_from(
                [
                    "completion_tokens",
                    "routed_experts",
                    "indexer_topk",
                    "cached_tokens",
                    "weight_version",
                    "e2e_latency",
                ]
            )
        )
        pairs.insert(0, (name, draw(values)))
    return Obj(pairs)


@st.composite
def choices(draw: st.DrawFn, index: int) -> Obj:
    message: list[tuple[str, Any]] = [("role", "assistant"), ("content", draw(texts))]
    if draw(st.booleans()):
        message.append(("reasoning_content", draw(texts | st.none() | values)))
    if draw(st.booleans()):
        message.append(("tool_calls", draw(st.sampled_from([[], None]) | st.lists(values))))
    pairs: list[tuple[str, Any]] = [
        ("index", index),
        ("message", Obj(message)),
        ("finish_reason", draw(st.sampled_from(["stop", "length", "tool_calls", None]))),
    ]
    if index == 0 or draw(st.booleans()):
        pairs.append(("meta_info", draw(metas())))
    pairs += draw(st.lists(st.tuples(texts, values), max_size=2))
    rnd = draw(st.randoms(use_true_random=False))
    rnd.shuffle(pairs)
    return Obj(pairs)


@st.composite
def reply_models(draw: st.DrawFn) -> Obj:
    n = draw(st.integers(1, 3))
    pairs: list[tuple[str, Any]] = [
        ("id", draw(texts)),
        ("object", "chat.completion"),
        ("choices", [draw(choices(i)) for i in range(n)]),
        ("usage", Obj([("prompt_tokens", 3), ("completion_tokens", 2)])),
    ]
    if draw(st.booleans()):
        # SGLang also reports the weight version at the top level.
        version = draw(texts | st.none() | values)
        pairs.append(("metadata", draw(st.just(Obj([("weight_version", version)])) | values)))
    pairs += draw(st.lists(st.tuples(texts, values), max_size=3))
    draw(st.randoms(use_true_random=False)).shuffle(pairs)
    if draw(st.integers(0, 5)) == 0:
        pairs.insert(0, ("choices", draw(values)))  # a decoy: the last "choices" wins
    return Obj(pairs)


@st.composite
def reply_bodies(draw: st.DrawFn) -> tuple[bytes, Obj]:
    model = draw(reply_models())
    writer = Writer(draw(st.randoms(use_true_random=False)), pretty=draw(st.booleans()))
    return writer.document(model), model


# Generating a reply costs tens of ms: 100 examples per property keep the file near 20 s.
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- extract_reply: equivalence ---------------------------------------------------------------


@SETTINGS
@given(reply_bodies())
def test_generated_replies_agree(case: tuple[bytes, Obj]) -> None:
    body, model = case
    assert core.json_reject(body) is None, "the Rust fast path must take every valid reply"
    expected = plain(model)
    outcome_py = outcome(PY.extract_reply, body)
    if outcome_py[0] == "err":
        # Duplicates can make the last choices[0] break the contract: both must say so.
        assert outcome(RUST.extract_reply, body) == outcome_py
        return
    r = assert_same_reply(body)
    assert json.loads(r.client_body) == stripped(expected)
    meta = expected["choices"][0]["meta_info"]
    assert r.completion_ids == [e[1] for e in meta["output_token_logprobs"]]
    r3 = meta.get("routed_experts")
    assert r.routed_experts == (None if r3 is None else r3.encode())
    topk = meta.get("indexer_topk")
    assert r.indexer_topk == (None if topk is None else topk.encode())
    assert r.cached_tokens == oracle_int(meta.get("cached_tokens"))
    assert r.weight_version == oracle_weight_version(expected)
    assert r.e2e_latency == oracle_float(meta.get("e2e_latency"))
    reasoning = expected["choices"][0]["message"].get("reasoning_content")
    if isinstance(reasoning, str):
        assert r.message["reasoning_content"] == reasoning
        assert list(r.message)[:3] == ["role", "content", "reasoning_content"]
    else:
        assert "reasoning_content" not in r.message


def oracle_int(value: Any) -> int | None:
    return value if type(value) is int else None


def oracle_float(value: Any) -> float | None:
    """A number as the float its JSON text reads as (an integer beyond range: +-inf)."""
    if type(value) not in (int, float):
        return None
    try:
        return float(value)
    except OverflowError:
        return float("inf") if value > 0 else float("-inf")


def oracle_weight_version(doc: dict[str, Any]) -> str | None:
    """meta_info's weight_version if a string, else the top-level metadata's, else None."""
    version = doc["choices"][0]["meta_info"].get("weight_version")
    if isinstance(version, str):
        return version
    metadata = doc.get("metadata")
    version = metadata.get("weight_version") if isinstance(metadata, dict) else None
    return version if isinstance(version, str) else None


def mutate(body: bytes, rnd: random.Random) -> bytes:
    kind = rnd.randrange(4)
    at = rnd.randrange(len(body) + 1)
    if kind == 0:
        return body[:at]
    if kind == 1 and at < len(body):
        return body[:at] + bytes([rnd.randrange(256)]) + body[at + 1 :]
    if kind == 2:
        return body[:at] + bytes([rnd.choice(b'{}[],:"\\ 0e-.\x00\xff\xc3')]) + body[at:]
    return body[:at] + body[at + 1 :]


@SETTINGS
@given(reply_bodies(), st.randoms(use_true_random=False))
def test_mutated_replies_agree(case: tuple[bytes, Obj], rnd: random.Random) -> None:
    body = case[0]
    for _ in range(3):
        body = mutate(body, rnd)
    r, p = outcome(RUST.extract_reply, body), outcome(PY.extract_reply, body)
    if p[0] == "ok":
        assert r[0] == "ok"
        assert_same_reply(body)
    else:
        assert r == p
        assert isinstance(p[1], type) and issubclass(p[1], ReplyContractError)


@SETTINGS
@given(reply_bodies(), st.randoms(use_true_random=False))
def test_scanner_accepts_exactly_what_json_accepts(
    case: tuple[bytes, Obj], rnd: random.Random
) -> None:
    """On strict UTF-8 without a BOM, the Rust scanner and json.loads agree."""
    body = mutate(case[0], rnd)
    try:
        json.loads(body.decode("utf-8"))
        accepted = True
    except ValueError:
        accepted = False
    assert (core.json_reject(body) is None) == accepted, body


BREAKS = [
    "top_list",
    "choices_missing",
    "choices_empty",
    "choices_object",
    "choice_not_object",
    "message_missing",
    "message_string",
    "content_null",
    "content_missing",
    "meta_missing",
    "meta_list",
    "entries_missing",
    "entries_object",
    "ct_missing",
    "ct_bool",
    "ct_float",
    "ct_string",
    "ct_off",
    "entry_bad",
    "r3_array",
    "topk_object",
]
BAD_ENTRIES: list[Any] = [
    "x",
    [],
    [0.5],
    [0.5, 1.0],
    [0.5, True],
    ["a", 1],
    [None, 1],
    None,
    Obj([("a", 1)]),
    [0.5, 10**30 + 0.5],
    [[0.5], 1],
    ["x" * 200, 3],
]


def _set(obj: Obj, key: str, value: Any) -> None:
    obj.pairs = [(k, v) for k, v in obj.pairs if k != key]
    if value is not _DROP:
        obj.pairs.append((key, value))


_DROP = object()


def _last(model: Obj, key: str) -> Any:
    return [v for k, v in model.pairs if k == key][-1]


def break_reply(model: Obj, how: str, rnd: random.Random) -> Any:
    try:
        return _break_reply(model, how, rnd)
    except (IndexError, AttributeError, TypeError):
        # The generator's duplicate keys can leave a later, winning member that is not the
        # valid one (e.g. an empty meta_info after the real one): nothing left to break.
        reject()


def _break_reply(model: Obj, how: str, rnd: random.Random) -> Any:
    choices_ = _last(model, "choices")
    choice = choices_[0]
    message = _last(choice, "message")
    meta = _last(choice, "meta_info")
    if how == "top_list":
        return [plain(model)]
    table: dict[str, tuple[Obj, str, Any]] = {
        "choices_missing": (model, "choices", _DROP),
        "choices_empty": (model, "choices", []),
        "choices_object": (model, "choices", Obj([])),
        "message_missing": (choice, "message", _DROP),
        "message_string": (choice, "message", "hi"),
        "content_null": (message, "content", None),
        "content_missing": (message, "content", _DROP),
        "meta_missing": (choice, "meta_info", _DROP),
        "meta_list": (choice, "meta_info", [1]),
        "entries_missing": (meta, "output_token_logprobs", _DROP),
        "entries_object": (meta, "output_token_logprobs", Obj([])),
        "ct_missing": (meta, "completion_tokens", _DROP),
        "ct_bool": (meta, "completion_tokens", True),
        "ct_float": (meta, "completion_tokens", 1.0),
        "ct_string": (meta, "completion_tokens", "3"),
        "r3_array": (meta, "routed_experts", [1, 2]),
        "topk_object": (meta, "indexer_topk", Obj([("a", 1)])),
    }
    if how == "choice_not_object":
        choices_[0] = "choice"
    elif how == "ct_off":
        items = _last(meta, "output_token_logprobs")
        _set(meta, "completion_tokens", len(items) + rnd.choice([1, -1, 100]))
    elif how == "entry_bad":
        items = list(_last(meta, "output_token_logprobs"))
        items.insert(rnd.randrange(len(items) + 1), rnd.choice(BAD_ENTRIES))
        _set(meta, "output_token_logprobs", items)
        _set(meta, "completion_tokens", len(items))
    else:
        target, key, value = table[how]
        _set(target, key, value)
    return model


@SETTINGS
@given(reply_models(), st.sampled_from(BREAKS), st.randoms(use_true_random=False))
def test_broken_replies_same_error(model: Obj, how: str, rnd: random.Random) -> None:
    broken = break_reply(model, how, rnd)
    body = Writer(rnd, pretty=rnd.random() < 0.5).document(broken)
    err = assert_same_error(body)
    assert err[1] is ReplyContractError and err[2].startswith(PREFIX)
    if how not in ("r3_array", "topk_object"):
        with pytest.raises(UpstreamError) as info:
            parse_reply(body)
        assert err[2] == str(info.value), "the twin must keep reply.py's 502 messages"


# --- extract_reply: fixed cases ---------------------------------------------------------------


def reply(meta: str = "", *, content: str = '"hi"', extra_choices: str = "") -> bytes:
    base = '"output_token_logprobs":[[-0.5,7,null],[-1,8,null]],"completion_tokens":2'
    # "" or ",...": the two base entries first; "...BASE...": placed; else the whole meta.
    meta = base + meta if not meta or meta.startswith(",") else meta.replace("BASE", base)
    text = (
        '{"id":"r","choices":[{"index":0,"message":{"role":"assistant","content":'
        + content
        + '},"finish_reason":"stop","meta_info":{'
        + meta
        + "}}"
        + extra_choices
        + "]}"
    )
    return text.encode()


CONTRACT_CASES = {
    b"nope": "body is not valid JSON (Expecting value: line 1 column 1 (char 0))",
    b"": "body is not valid JSON (Expecting value: line 1 column 1 (char 0))",
    b'{"a":1} x': "body is not valid JSON (Extra data: line 1 column 9 (char 8))",
    b'{"a":"\xff"}': (
        "body is not valid JSON ('utf-8' codec can't decode byte 0xff in position 6: "
        "invalid start byte)"
    ),
    b"[]": "body is not a JSON object",
    b'"s"': "body is not a JSON object",
    b"{}": "'choices' is missing or empty",
    b'{"choices":[]}': "'choices' is missing or empty",
    b'{"choices":{}}': "'choices' is missing or empty",
    b'{"choices":[1]}': "'choices' is missing or empty",
    b'{"choices":[{}]}': "choices[0].message is missing",
    b'{"choices":[{"message":[]}]}': "choices[0].message is missing",
    b'{"choices":[{"message":{}}]}': "choices[0].message.content is null",
    b'{"choices":[{"message":{"content":null}}]}': "choices[0].message.content is null",
    b'{"choices":[{"message":{"content":""}}]}': (
        "choices[0].meta_info is missing (was return_meta_info honoured?)"
    ),
    b'{"choices":[{"message":{"content":""},"meta_info":null}]}': (
        "choices[0].meta_info is missing (was return_meta_info honoured?)"
    ),
    b'{"choices":[{"message":{"content":""},"meta_info":{}}]}': (
        "choices[0].meta_info.output_token_logprobs is missing"
    ),
    b'{"choices":[{"message":{"content":""},"meta_info":{"output_token_logprobs":{}}}]}': (
        "choices[0].meta_info.output_token_logprobs is missing"
    ),
    reply('"output_token_logprobs":[]'): "choices[0].meta_info.completion_tokens is missing",
    reply('"output_token_logprobs":[],"completion_tokens":false'): (
        "choices[0].meta_info.completion_tokens is missing"
    ),
    reply('"output_token_logprobs":[],"completion_tokens":0.0'): (
        "choices[0].meta_info.completion_tokens is missing"
    ),
    reply('"output_token_logprobs":[],"completion_tokens":1e0'): (
        "choices[0].meta_info.completion_tokens is missing"
    ),
    reply('"output_token_logprobs":[],"completion_tokens":-1'): (
        "output_token_logprobs has 0 entries but completion_tokens is -1"
    ),
    reply('"output_token_logprobs":[[0,1]],"completion_tokens":2'): (
        "output_token_logprobs has 1 entries but completion_tokens is 2"
    ),
    reply('"output_token_logprobs":[[0,1],[0]],"completion_tokens":2'): (
        "output_token_logprobs[1] is not [logprob, token_id, ...]: [0]"
    ),
    reply('"output_token_logprobs":[[0,1.0]],"completion_tokens":1'): (
        "output_token_logprobs[0] is not [logprob, token_id, ...]: [0, 1.0]"
    ),
    reply('"output_token_logprobs":[[0,true]],"completion_tokens":1'): (
        "output_token_logprobs[0] is not [logprob, token_id, ...]: [0, True]"
    ),
    reply('"output_token_logprobs":[["-1",1]],"completion_tokens":1'): (
        "output_token_logprobs[0] is not [logprob, token_id, ...]: ['-1', 1]"
    ),
    reply('"output_token_logprobs":[{"a":1}],"completion_tokens":1'): (
        "output_token_logprobs[0] is not [logprob, token_id, ...]: {'a': 1}"
    ),
    reply('"output_token_logprobs":[["' + "\u00e9" * 100 + '",1]],"completion_tokens":1'): (
        "output_token_logprobs[0] is not [logprob, token_id, ...]: ['" + "\u00e9" * 78
    ),
    reply(content="null"): "choices[0].message.content is null",
    reply(',"routed_experts":{}'): (
        "choices[0].meta_info.routed_experts is not a base64 string (got object)"
    ),
    reply(',"routed_experts":7'): (
        "choices[0].meta_info.routed_experts is not a base64 string (got number)"
    ),
    reply(',"indexer_topk":[1,2]'): (
        "choices[0].meta_info.indexer_topk is not a base64 string (got array)"
    ),
    reply(',"indexer_topk":false'): (
        "choices[0].meta_info.indexer_topk is not a base64 string (got boolean)"
    ),
    # routed_experts is checked first.
    reply(',"indexer_topk":1,"routed_experts":{}'): (
        "choices[0].meta_info.routed_experts is not a base64 string (got object)"
    ),
}


@pytest.mark.parametrize("body", list(CONTRACT_CASES))
def test_contract_errors(body: bytes) -> None:
    err = assert_same_error(body)
    assert err[1] is ReplyContractError
    assert err[2] == PREFIX + CONTRACT_CASES[body]
    assert issubclass(ReplyContractError, ValueError)
    assert RUST.ReplyContractError is errors.ReplyContractError is PY.ReplyContractError
    if b"routed_experts" not in body and b"indexer_topk" not in body:
        with pytest.raises(UpstreamError) as info:
            parse_reply(body)
        assert str(info.value) == err[2]


def test_fields() -> None:
    body = reply(
        ',"finish_reason":{"type":"stop","matched":2},"prompt_tokens":5,"routed_experts":"QUJD"',
        content='"caf\\u00e9 \\ud83d\\ude00"',
    )
    r = assert_same_reply(body)
    assert r.completion_ids == [7, 8] and r.logprobs == [-0.5, -1.0]
    assert type(r.logprobs[1]) is float
    assert r.completion_tokens == 2 and r.prompt_tokens == 5
    assert r.finish_reason == {"type": "stop", "matched": 2}
    assert r.message == {"role": "assistant", "content": "café 😀"}
    assert r.routed_experts == b"QUJD" and type(r.routed_experts) is bytes
    # No meta_info.finish_reason: the choice's; no prompt_tokens: None.
    r = assert_same_reply(reply(',"prompt_tokens":null'))
    assert r.finish_reason == "stop" and r.prompt_tokens is None and r.routed_experts is None
    # meta_info.finish_reason null still wins (dict.get semantics).
    assert assert_same_reply(reply(',"finish_reason":null')).finish_reason is None
    # tool_calls only when truthy.
    calls = '"x","tool_calls":[{"id":"c"}]'
    assert assert_same_reply(reply(content=calls)).message["tool_calls"] == [{"id": "c"}]
    assert "tool_calls" not in assert_same_reply(reply(content='"x","tool_calls":[]')).message
    assert "tool_calls" not in assert_same_reply(reply(content='"x","tool_calls":null')).message


def test_logprob_forms() -> None:
    items = "[true,1],[false,2],[-0.0,3],[1e-400,4],[-1e400,5],[-Infinity,6],[-0,7],[3,8,9,10]"
    r = assert_same_reply(reply(f'"output_token_logprobs":[{items}],"completion_tokens":8'))
    assert r.logprobs[:2] == [1.0, 0.0] and r.logprobs[5] == float("-inf")
    assert r.completion_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    body = reply('"output_token_logprobs":[[NaN,1]],"completion_tokens":1')
    for impl in (RUST, PY):
        lp = impl.extract_reply(body).logprobs[0]
        assert lp != lp


def test_logprob_entry_text() -> None:
    """SGLang's entries are [logprob, token_id, text]: a string or a null text is fine."""
    items = '[-0.5,7,"Hello"],[-1,8,null],[-0.25,9,"\\u00e9\\n"],[0,10,""]'
    r = assert_same_reply(reply(f'"output_token_logprobs":[{items}],"completion_tokens":4'))
    assert r.completion_ids == [7, 8, 9, 10] and r.logprobs == [-0.5, -1.0, -0.25, 0.0]


def with_top(body: bytes, member: str, *, first: bool = True) -> bytes:
    """`body` with a top-level member added before (or after) all the others."""
    if first:
        return body.replace(b'{"id":"r",', b"{" + member.encode() + b',"id":"r",', 1)
    return body[:-1] + b"," + member.encode() + b"}"


@pytest.mark.parametrize(
    ("extra", "want"),
    [
        ("", None),
        (',"reasoning_content":null', None),
        (',"reasoning_content":"think"', "think"),
        (',"reasoning_content":""', ""),
        (',"reasoning_content":"caf\\u00e9 \\ud800"', "café \ud800"),
        (',"reasoning_content":7', None),
        (',"reasoning_content":["a"]', None),
        (',"reasoning_content":{"a":1}', None),
        (',"reasoning_content":"a","reasoning_content":null', None),
        (',"reasoning_content":null,"reasoning_content":"b"', "b"),
    ],
)
def test_reasoning_content(extra: str, want: str | None) -> None:
    message = assert_same_reply(reply(content='"x"' + extra)).message
    if want is None:
        assert message == {"role": "assistant", "content": "x"}
    else:
        assert message == {"role": "assistant", "content": "x", "reasoning_content": want}
        assert type(message["reasoning_content"]) is str


def test_reasoning_content_key_order() -> None:
    # tool_calls before reasoning_content in the reply: role, content, reasoning, tool_calls.
    body = reply(content='"x","tool_calls":[{"id":"c"}],"reasoning_content":"r"')
    for impl in (RUST, PY):
        message = impl.extract_reply(body).message
        assert list(message) == ["role", "content", "reasoning_content", "tool_calls"]
        assert message["reasoning_content"] == "r" and message["tool_calls"] == [{"id": "c"}]


@pytest.mark.parametrize(
    ("meta", "top", "want"),
    [
        ("", "", None),
        (',"weight_version":"w1"', "", "w1"),
        (',"weight_version":"w1"', '"metadata":{"weight_version":"top"}', "w1"),
        ("", '"metadata":{"weight_version":"top"}', "top"),
        (',"weight_version":null', '"metadata":{"weight_version":"top"}', "top"),
        (',"weight_version":3', '"metadata":{"a":1,"weight_version":"top","b":[]}', "top"),
        (',"weight_version":{"v":"x"}', "", None),
        (',"weight_version":""', '"metadata":{"weight_version":"top"}', ""),
        ("", '"metadata":{"weight_version":null}', None),
        ("", '"metadata":{"weight_version":7}', None),
        ("", '"metadata":{}', None),
        ("", '"metadata":["weight_version"]', None),
        ("", '"metadata":"top"', None),
        ("", '"metadata":{"x":{"weight_version":"deep"}}', None),
        ("", '"weight_version":"top-level, not in metadata"', None),
        (',"weight_version":"\\u0077\\/\\ud800"', "", "w/\ud800"),
        ("", '"metadata":{"weight_version":"caf\\u00e9"}', "café"),
        # Duplicates: the last member wins, at every level.
        (',"weight_version":"a","weight_version":null', "", None),
        (',"weight_version":1,"weight_version":"b"', "", "b"),
        ("", '"metadata":{"weight_version":"a"},"metadata":{}', None),
        ("", '"metadata":{"weight_version":"a","weight_version":"b"}', "b"),
    ],
)
def test_weight_version(meta: str, top: str, want: str | None) -> None:
    body = reply(meta)
    for first in (True, False):
        r = assert_same_reply(with_top(body, top, first=first) if top else body)
        assert r.weight_version == want
        assert want is None or type(r.weight_version) is str


@pytest.mark.parametrize(
    ("meta", "want"),
    [
        ("", None),
        (',"e2e_latency":0.125', 0.125),
        (',"e2e_latency":3', 3.0),
        (',"e2e_latency":-0.0', -0.0),
        (',"e2e_latency":2.5E-3', 0.0025),
        (',"e2e_latency":' + "9" * 400, float("inf")),
        (',"e2e_latency":-1e999', float("-inf")),
        (',"e2e_latency":Infinity', float("inf")),
        (',"e2e_latency":null', None),
        (',"e2e_latency":true', None),
        (',"e2e_latency":"0.5"', None),
        (',"e2e_latency":[0.5]', None),
        # Duplicates: the last member wins.
        (',"e2e_latency":"x","e2e_latency":1.5', 1.5),
        (',"e2e_latency":1.5,"e2e_latency":{}', None),
    ],
)
def test_e2e_latency(meta: str, want: float | None) -> None:
    r = assert_same_reply(reply(meta))
    assert r.e2e_latency == want
    assert want is None or type(r.e2e_latency) is float


def test_e2e_latency_nan_and_only_from_choice_zero() -> None:
    for impl in (RUST, PY):
        value = impl.extract_reply(reply(',"e2e_latency":NaN')).e2e_latency
        assert value is not None and value != value
    other = ',{"index":1,"message":{"content":"b"},"meta_info":{"e2e_latency":1.0}}'
    assert assert_same_reply(reply(extra_choices=other)).e2e_latency is None


def test_weight_version_only_from_choice_zero() -> None:
    other = ',{"index":1,"message":{"content":"b"},"meta_info":{"weight_version":"other"}}'
    assert assert_same_reply(reply(extra_choices=other)).weight_version is None
    # metadata inside a choice is not the top-level one.
    body = reply().replace(b'"index":0,', b'"index":0,"metadata":{"weight_version":"c"},')
    assert assert_same_reply(body).weight_version is None


@pytest.mark.parametrize(
    ("meta", "want"),
    [
        ("", None),
        (',"cached_tokens":0', 0),
        (',"cached_tokens":17', 17),
        (',"cached_tokens":-1', -1),
        (',"cached_tokens":9223372036854775807', 2**63 - 1),
        (',"cached_tokens":null', None),
        (',"cached_tokens":true', None),
        (',"cached_tokens":false', None),
        (',"cached_tokens":1.0', None),
        (',"cached_tokens":1e2', None),
        (',"cached_tokens":"3"', None),
        (',"cached_tokens":[3]', None),
        (',"cached_tokens":3,"cached_tokens":null', None),
        (',"cached_tokens":"3","cached_tokens":4', 4),
    ],
)
def test_cached_tokens(meta: str, want: int | None) -> None:
    r = assert_same_reply(reply(meta))
    assert r.cached_tokens == want
    assert want is None or type(r.cached_tokens) is int


@pytest.mark.parametrize(
    ("meta", "want"),
    [
        ("", None),
        (',"indexer_topk":null', None),
        (',"indexer_topk":"QUJD"', b"QUJD"),
        (',"indexer_topk":""', b""),
        (',"indexer_topk":"QU\\/D\\u0041"', b"QU/DA"),
        ('"indexer_topk":"QUJD","routed_experts":"AAAA",BASE', b"QUJD"),
        (',"indexer_topk":[1],"indexer_topk":"QUJD"', b"QUJD"),
        (',"indexer_topk":"QUJD","indexer_topk":null', None),
    ],
)
def test_indexer_topk(meta: str, want: bytes | None) -> None:
    body = reply(meta)
    r = assert_same_reply(body)
    assert r.indexer_topk == want and (want is None or type(r.indexer_topk) is bytes)
    assert b"indexer_topk" not in r.client_body
    assert json.loads(r.client_body) == stripped(json.loads(body))


@pytest.mark.parametrize(
    ("meta", "client_meta"),
    [
        ('"routed_experts":"QUJD",BASE', "BASE"),
        ('BASE,"routed_experts":"QUJD"', "BASE"),
        ('"routed_experts":"QUJD","indexer_topk":"QQ==",BASE', "BASE"),
        ('BASE,"routed_experts":"QUJD","indexer_topk":"AAAA"', "BASE"),
        ('"indexer_topk":null,"routed_experts":"QUJD",BASE', "BASE"),
        ('"a":1,"routed_experts":"QUJD","b":2,"indexer_topk":"QQ==",BASE', '"a":1,"b":2,BASE'),
        (
            ' "routed_experts" : "QUJD" ,\n "x":{"routed_experts":1} , BASE ',
            ' "x":{"routed_experts":1} , BASE ',
        ),
        ('BASE ,\n\t"routed_experts"\t:\t"QUJD"\n', "BASE\n"),
        ('"routed_\\u0065xperts":"QUJD",BASE', "BASE"),
        ('"routed_experts":"x","routed_experts":"QUJD",BASE', "BASE"),
    ],
)
def test_splice_exact_bytes(meta: str, client_meta: str) -> None:
    r = assert_same_reply(reply(meta))
    assert r.client_body == reply(client_meta)
    assert r.routed_experts == b"QUJD"


def test_splice_only_member_and_several_choices() -> None:
    other = (
        ',{"index":1,"message":{"content":"b"},"meta_info":{"routed_experts":"QUJD"}}'
        ',{"index":2,"meta_info":{"indexer_topk":"x","k":1,"routed_experts":"QUJD"}}'
        ',{"index":3,"meta_info":[1]},7'
    )
    body = reply(',"routed_experts":"QUJD"', extra_choices=other)
    r = assert_same_reply(body)
    doc = json.loads(r.client_body)
    assert [c["meta_info"] if isinstance(c, dict) else c for c in doc["choices"][1:]] == [
        {},
        {"k": 1},
        [1],
        7,
    ]
    assert b'"meta_info":{}' in r.client_body
    assert b"routed_experts" not in r.client_body and b"indexer_topk" not in r.client_body


def test_duplicate_keys_last_wins() -> None:
    # Two "choices": the last one counts; R3 is cut from both.
    first = '"choices":[{"message":{"content":null},"meta_info":{"routed_experts":"AAAA"}}]'
    body = reply(',"routed_experts":"QUJD"').replace(b'{"id":"r",', b"{" + first.encode() + b",")
    r = assert_same_reply(body)
    assert r.routed_experts == b"QUJD" and b"AAAA" not in r.client_body
    # Duplicate members inside meta_info and message.
    r = assert_same_reply(reply(',"completion_tokens":2,"prompt_tokens":"x","prompt_tokens":4'))
    assert r.prompt_tokens == 4
    r = assert_same_reply(reply(content='null,"content":"second"'))
    assert r.message["content"] == "second"
    assert_same_error(reply(content='"first","content":null'))


def test_escapes_and_lone_surrogates() -> None:
    # Lone surrogates are legal JSON escapes (json.loads keeps them); both twins agree.
    body = reply(',"routed_experts":"QU\\/D\\u0041"', content='"a\\ud800b\\udc00"')
    r = assert_same_reply(body)
    assert r.message["content"] == "a\ud800b\udc00"
    assert r.routed_experts == b"QU/DA"
    assert core.json_reject(body) is None


def test_inputs_the_twin_decides() -> None:
    """Valid for json.loads but outside the Rust fast path: same results via the twin."""
    good = reply(',"routed_experts":"QUJD"')
    cases = [
        b"\xef\xbb\xbf" + good,  # UTF-8 BOM
        good.decode().encode("utf-16"),
        good.decode().encode("utf-32-le"),
        reply(content='"X"').replace(b'"X"', b'"\xed\xa0\x80"'),  # surrogatepass
        reply('"output_token_logprobs":[[-0.5,99999999999999999999]],"completion_tokens":1'),
        reply('"output_token_logprobs":[[10000000000000000000000,1]],"completion_tokens":1'),
        reply(',"prompt_tokens":123456789012345678901234567890'),
        reply(',"cached_tokens":-123456789012345678901234567890,"indexer_topk":"QUJD"'),
        reply(',"deep":' + "[" * 300 + "]" * 300),
    ]
    for body in cases:
        r, p = outcome(RUST.extract_reply, body), outcome(PY.extract_reply, body)
        assert r[0] == p[0] == "ok", (body[:60], r, p)
        assert_same_reply(body)
    huge = reply('"output_token_logprobs":[[-0.5,' + "9" * 5000 + ']],"completion_tokens":1')
    assert outcome(PY.extract_reply, huge)[0] == "err"  # CPython's int digit limit
    assert outcome(RUST.extract_reply, huge) == outcome(PY.extract_reply, huge)


def test_bytes_like_inputs() -> None:
    body = reply(',"routed_experts":"QUJD","indexer_topk":"QQ=="')
    want = fields_of(PY.extract_reply(body))
    for data in (bytearray(body), memoryview(body), memoryview(bytearray(body))[0:]):
        for impl in (RUST, PY):
            got = impl.extract_reply(data)
            assert fields_of(got) == want and type(got.client_body) is bytes
    for bad in ("text", 5, memoryview(body)[::2]):
        r, p = outcome(RUST.extract_reply, bad), outcome(PY.extract_reply, bad)
        assert r == p and r[1] is TypeError


def test_routed_experts_view_is_zero_copy() -> None:
    body = reply(',"routed_experts":"QUJD"')
    r = RUST.extract_reply(body)
    view = r.routed_experts_view
    assert view.obj is body and view.tobytes() == b"QUJD"
    assert r.routed_experts is r.routed_experts  # copied once, on first access
    # Not bytes (mutable or a view): copied at once, so later changes cannot leak in.
    data = bytearray(body)
    r = RUST.extract_reply(data)
    data[data.index(b"QUJD")] = ord("X")
    assert r.routed_experts == b"QUJD" and r.routed_experts_view.tobytes() == b"QUJD"


def test_indexer_topk_view_is_zero_copy() -> None:
    body = reply(',"routed_experts":"QUJD","indexer_topk":"QQ=="')
    r = RUST.extract_reply(body)
    view = r.indexer_topk_view
    assert view.obj is body and view.readonly and view.tobytes() == b"QQ=="
    assert view.tobytes() != r.routed_experts_view.tobytes()
    assert r.indexer_topk is r.indexer_topk  # copied once, on first access
    p = PY.extract_reply(body)
    assert p.indexer_topk_view.obj is body and p.indexer_topk_view.tobytes() == b"QQ=="
    data = bytearray(body)
    r = RUST.extract_reply(data)
    data[data.index(b"QQ==")] = ord("X")
    assert r.indexer_topk == b"QQ==" and r.indexer_topk_view.tobytes() == b"QQ=="
    assert r.routed_experts == b"QUJD"
    # Escaped text: a decoded copy (view of that copy).
    r = RUST.extract_reply(reply(',"indexer_topk":"QQ\\u003d="'))
    assert r.indexer_topk == b"QQ==" and r.indexer_topk_view.tobytes() == b"QQ=="


def test_result_is_read_only() -> None:
    for impl in (RUST, PY):
        r = impl.extract_reply(reply())
        with pytest.raises(AttributeError):
            r.completion_tokens = 3


# --- a real mock-engine reply -----------------------------------------------------------------


L, K, E = 4, 2, 16


@pytest.fixture(scope="module")
def engine_reply() -> tuple[bytes, Any]:
    from sessiongate.mock_engine.chat_request import ChatRequest
    from sessiongate.mock_engine.config import MockEngineConfig
    from sessiongate.mock_engine.generate import CompletionGenerator
    from sessiongate.mock_engine.reply import build_reply
    from sessiongate.mock_engine.state import EngineState
    from sessiongate.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    cfg = MockEngineConfig(r3_layers=L, r3_topk=K, r3_experts=E, tool_call_rate=1.0)
    gen = CompletionGenerator(tok, completion_tokens=40, tool_call_rate=1.0)
    tools = [{"type": "function", "function": {"name": "search", "parameters": {}}}]
    prompt = tok.encode("Hello there, mock engine. " * 20)
    completion = gen.generate(prompt, tools=tools)
    req = ChatRequest(
        prompt_ids=prompt,
        seed=None,
        max_tokens=None,
        tools=tools,
        stream=False,
        want_meta=True,
        want_logprobs=True,
        want_r3=True,
        model="mock",
    )
    state = EngineState(cfg, tok, gen)
    return b"".join(build_reply(req, completion, state, "req-1")), completion


def test_mock_engine_reply(engine_reply: tuple[bytes, Any]) -> None:
    body, completion = engine_reply
    r = assert_same_reply(body)
    assert r.completion_ids == completion.ids and r.logprobs == completion.logprobs
    assert r.prompt_tokens == completion.prompt_tokens
    assert r.cached_tokens == 0 and r.weight_version == "default"
    assert r.indexer_topk is None and r.indexer_topk_view is None
    doc = json.loads(body)
    assert json.loads(r.client_body) == stripped(doc)
    assert r.routed_experts == doc["choices"][0]["meta_info"]["routed_experts"].encode()
    assert r.routed_experts_view.obj is body
    assert len(r.client_body) == len(body) - len(r.routed_experts) - len(',"routed_experts":""')
    views = [impl.decode_r3(r.routed_experts, layers=L, topk=K) for impl in (RUST, PY)]
    rows = completion.prompt_tokens + completion.completion_tokens - 1
    for view in views:
        assert view.shape == (rows, L, K) and view.format == "i"
        assert all(0 <= x < E for x in view.cast("B").cast("i"))
    assert views[0].tolist() == views[1].tolist()


# --- rewrite_request --------------------------------------------------------------------------

field_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | texts,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.tuples(inner, inner)
        | st.dictionaries(texts, inner, max_size=3)
    ),
    max_leaves=20,
)
field_names = (
    st.sampled_from(
        ["input_ids", "logprobs", "stream", "return_meta_info", "no_stop_trim", "é", 'q"'] * 2
    )
    | texts
)


@st.composite
def request_bodies(draw: st.DrawFn) -> bytes:
    pairs = draw(st.lists(st.tuples(field_names, values), max_size=6))
    writer = Writer(draw(st.randoms(use_true_random=False)), pretty=draw(st.booleans()))
    return writer.document(Obj(pairs))


def canon(value: Any) -> Any:
    """json.loads(json.dumps(value)): tuples become lists."""
    return json.loads(json.dumps(value))


@SETTINGS
@given(request_bodies(), st.dictionaries(field_names, field_values, max_size=4))
def test_rewrite_agrees(body: bytes, fields: dict[str, Any]) -> None:
    r, p = RUST.rewrite_request(body, fields), PY.rewrite_request(body, fields)
    assert type(r) is bytes
    expected = json.loads(body)
    expected.update(canon(fields))
    assert json.loads(r) == json.loads(p) == expected


@pytest.mark.parametrize(
    ("body", "fields", "want"),
    [
        (b"{}", {"a": 1}, b'{"a":1}'),
        (b"{ }", {}, b"{ }"),
        (b" {\n} ", {"a": [1, 2]}, b' {"a":[1,2]\n} '),
        (b'{"a":0}', {"a": 1}, b'{"a":1}'),
        (b'{"a":0,"a":2,"b":3}', {"a": 1}, b'{"b":3,"a":1}'),
        (b'{"b":3,"a":0,"a":2}', {"a": 1}, b'{"b":3,"a":1}'),
        (b'{ "a" : 0 , "b" : 3 }', {"a": None, "c": "é"}, '{ "b" : 3,"a":null,"c":"é" }'.encode()),
        (b'{"\\u0061":0,"b":1}', {"a": True}, b'{"b":1,"a":true}'),
        (b'{"x":[1,{"a":2}]}', {"a": 1.5}, b'{"x":[1,{"a":2}],"a":1.5}'),
    ],
)
def test_rewrite_exact(body: bytes, fields: dict[str, Any], want: bytes) -> None:
    assert RUST.rewrite_request(body, fields) == want
    assert json.loads(PY.rewrite_request(body, fields)) == json.loads(want)


class Color(IntEnum):
    RED = 1


def test_rewrite_values_like_json_dumps() -> None:
    ids = list(range(-5, 1_000_000))
    values: list[Any] = [
        ids,
        (1, "two", None),
        {"k": [1.0, -0.0, 1e16, 1e-7, 0.1, float("inf"), float("-inf")]},
        2**64,
        -(2**63),
        Color.RED,
        True,
        '\x00\x1f"\\/\u2028é😀',
        {"1": 1, "nested": {"deep": [[[]]]}},
        {1: "int key", None: 0},
    ]
    for value in values:
        out = RUST.rewrite_request(b"{}", {"v": value})
        want = b'{"v":' + json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
        assert out == want + b"}", value
        assert PY.rewrite_request(b"{}", {"v": value}) == out
    nan = RUST.rewrite_request(b"{}", {"v": float("nan")})
    assert nan == b'{"v":NaN}' == PY.rewrite_request(b"{}", {"v": float("nan")})
    lone = {"v": "a\ud800"}
    assert json.loads(RUST.rewrite_request(b"{}", lone)) == lone
    assert json.loads(PY.rewrite_request(b"{}", lone)) == lone


@settings(max_examples=200, deadline=None)
@given(
    ids=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=300),
    typecode=st.sampled_from("qqqlibBhHIQ"),
)
def test_rewrite_writes_integer_arrays_as_their_lists(ids: list[int], typecode: str) -> None:
    # A session's token ids travel as array('q') (session/core.py): written from the buffer
    # by the compiled writer, through tolist() by the twin, always as the list would be.
    try:
        values = array(typecode, ids)
    except OverflowError:
        reject()
    fields = {"input_ids": values, "logprobs": True}
    want = RUST.rewrite_request(b'{"a":1}', {"input_ids": values.tolist(), "logprobs": True})
    assert RUST.rewrite_request(b'{"a":1}', fields) == want
    assert PY.rewrite_request(b'{"a":1}', fields) == want


def test_rewrite_refuses_other_arrays_as_json_does() -> None:
    for value in (array("d", [1.5]), array("u", "ab"), [array("f")]):
        r = outcome(RUST.rewrite_request, b"{}", {"v": value})
        assert r == outcome(PY.rewrite_request, b"{}", {"v": value})
        assert r[:2] == ("err", TypeError), r


def test_rewrite_errors() -> None:
    circular: list[Any] = []
    circular.append(circular)
    deep: Any = []
    for _ in range(100):
        deep = [deep]
    cases: list[tuple[Any, Any]] = [
        (b"[1]", {}),
        (b'"s"', {}),
        (b"null", {}),
        (b"1.5", {}),
        (b"true", {}),
        (b"{", {}),
        (b"", {}),
        (b'{"a":1} x', {}),
        (b"\xff", {}),
        (b"{}", [("a", 1)]),
        (b"{}", {1: 2}),
        ("{}", {}),
        (b"{}", {"v": {1, 2}}),
        (b"{}", {"v": [1, object()]}),
        (b"{}", {"v": circular}),
        (b"{", {"v": {1}}),
        (b"[]", {"v": {1}}),
    ]
    for body, fields in cases:
        r, p = (
            outcome(RUST.rewrite_request, body, fields),
            outcome(PY.rewrite_request, body, fields),
        )
        assert r == p, (body, fields)
        assert r[0] == "err"
    assert outcome(RUST.rewrite_request, b"[1]", {})[1:] == (
        RequestRewriteError,
        "request body must be a JSON object, got array",
    )
    assert outcome(RUST.rewrite_request, b"{", {})[2].startswith(
        "request body is not valid JSON: Expecting property name"
    )
    assert json.loads(RUST.rewrite_request(b"{}", {"v": deep})) == {"v": deep}
    # Inputs only json.loads takes (BOM, UTF-16): through the twin, same bytes.
    for body in (b'\xef\xbb\xbf{"a":1}', '{"a":1}'.encode("utf-16")):
        assert RUST.rewrite_request(body, {"b": 2}) == PY.rewrite_request(body, {"b": 2})


# --- decode_r3 --------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 6),
    st.integers(1, 4),
    st.integers(0, 30),
    st.randoms(use_true_random=False),
)
def test_decode_r3_round_trip(layers: int, topk: int, tokens: int, rnd: random.Random) -> None:
    values = array("i", [rnd.randrange(-(2**31), 2**31) for _ in range(tokens * layers * topk)])
    wire = array("i", values)
    if sys.byteorder == "big":
        wire.byteswap()  # the wire format is little-endian
    text = base64.b64encode(wire.tobytes())
    for data in (text, text.decode(), bytearray(text), memoryview(text)):
        views = [impl.decode_r3(data, layers=layers, topk=topk) for impl in (RUST, PY)]
        for view in views:
            assert view.format == "i" and view.readonly and view.itemsize == 4
            if tokens:
                assert view.shape == (tokens, layers, topk)
                flat = view.cast("B").cast("i")
            else:
                assert view.shape == (0,)
                flat = view
            assert flat.tolist() == values.tolist()


R3_BAD = [
    ("QUJD\n", "R3 data is not valid base64: character at offset 4 is not in the base64 alphabet"),
    ("QU=D", "R3 data is not valid base64: '=' at offset 2 is not at the end"),
    ("Q===", "R3 data is not valid base64: 3 '=' at the end (at most 2)"),
    ("====", "R3 data is not valid base64: 4 '=' at the end (at most 2)"),
    ("QUJDR", "R3 data is not valid base64: length 5 is not a multiple of 4"),
    ("QQ=", "R3 data is not valid base64: length 3 is not a multiple of 4"),
    ("QUJDé", "R3 data is not valid base64: character at offset 4 is not in the base64 alphabet"),
    (
        "QU\ud800D",
        "R3 data is not valid base64: character at offset 2 is not in the base64 alphabet",
    ),
    (
        "QUJD-_==",
        "R3 data is not valid base64: character at offset 4 is not in the base64 alphabet",
    ),
    ("QUJD", "R3 data decodes to 3 bytes, not a multiple of 4*layers*topk = 4*1*1 = 4 bytes"),
    ("QUJDRA==", "R3 data decodes to 4 bytes, not a multiple of 4*layers*topk = 4*2*1 = 8 bytes"),
    (
        "QUJ!RA==",
        "R3 data is not valid base64: character at offset 3 is not in the base64 alphabet",
    ),
]


@pytest.mark.parametrize(("data", "message"), R3_BAD)
def test_decode_r3_errors(data: str, message: str) -> None:
    layers = 2 if "8 bytes" in message else 1
    for arg in (data, data.encode("utf-8", "surrogatepass")):
        r = outcome(RUST.decode_r3, arg, layers=layers, topk=1)
        p = outcome(PY.decode_r3, arg, layers=layers, topk=1)
        assert r == p == ("err", ValueError, message)


def test_decode_r3_argument_errors() -> None:
    cases: list[tuple[Any, Any, Any]] = [
        (b"", 0, 1),
        (b"", 1, -1),
        (b"", 1, 2**70),
        (b"", 1.0, 1),
        (b"", 1, "2"),
        (5, 1, 1),
        (memoryview(b"QUJDQUJD")[::2], 1, 1),
    ]
    for data, layers, topk in cases:
        r = outcome(RUST.decode_r3, data, layers=layers, topk=topk)
        p = outcome(PY.decode_r3, data, layers=layers, topk=topk)
        assert r == p and r[0] == "err", (data, layers, topk)
    assert RUST.decode_r3(b"QUJDRA==", layers=True, topk=1).tolist() == [[[1145258561]]]


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=40), st.randoms(use_true_random=False))
def test_decode_r3_mutations_agree(raw: bytes, rnd: random.Random) -> None:
    text = base64.b64encode(raw)
    if text and rnd.random() < 0.7:
        at = rnd.randrange(len(text))
        text = (
            text[:at] + bytes([rnd.choice(string.printable.encode() + b"=\xc3")]) + text[at + 1 :]
        )
    topk = rnd.choice([1, 2, 3])
    r = outcome(RUST.decode_r3, text, layers=1, topk=topk)
    p = outcome(PY.decode_r3, text, layers=1, topk=topk)
    if r[0] == "ok":
        assert p[0] == "ok" and r[1].tolist() == p[1].tolist() and r[1].shape == p[1].shape
    else:
        assert r == p


def test_decode_r3_large() -> None:
    values = array("i", range(-(1 << 19), 1 << 19))
    text = base64.b64encode(values.tobytes())
    view = RUST.decode_r3(text, layers=8, topk=4)
    assert view.shape == (len(values) // 32, 8, 4)
    assert view.cast("B").cast("i").tolist() == values.tolist()
    assert view.tobytes() == PY.decode_r3(text, layers=8, topk=4).tobytes()


def test_threads_share_nothing(engine_reply: tuple[bytes, Any]) -> None:
    """extract_reply runs its scan without the GIL: concurrent calls stay correct."""
    body = engine_reply[0]
    big = body.replace(
        b'"routed_experts":"', b'"pad":"' + b"QUJD" * (1 << 18) + b'","routed_experts":"'
    )
    want = fields_of(PY.extract_reply(big))
    results: list[Any] = []

    def work() -> None:
        for _ in range(3):
            results.append(fields_of(RUST.extract_reply(big)))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 12 and all(r == want for r in results)

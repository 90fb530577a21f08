"""Engine routing policies: the Rust core (`_core.EnginePolicy`) and the pure-Python
specification (`sessiongate.engines.policy`) must pick the same engine for every request of
any sequence of requests, completions, load reports, health changes and trims, for every
policy and any tunables (random policies seeded alike).

Prompts come from a small alphabet so that they share prefixes, split tree edges and tie;
bodies vary the field that carries the prompt, escapes, duplicate keys and malformed input.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessiongate.engines.policy import POLICIES, get_engine_policy

RUST = get_engine_policy("rust")
PY = get_engine_policy("python")
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
URLS = ["http://e0:1", "http://e1:2", "http://e2:3", "http://e3:4", "http://e4:5"]

texts = st.text(alphabet="ab\u00e9\U0001f600", max_size=12)
RIDS = [
    "conv", "conv_t1", "conv_t2_r1", "conv_r3", "conv_r1_t2", "conv_t", "_t1", "_t1_r2",
    "k1_t2", "d\u00e9j\u00e0_t1", "c\ud800_t1", "", "x" * 128 + "_t1", "x" * 129, 7, ["conv"],
]  # fmt: skip
id_lists = st.lists(st.integers(0, 4), max_size=14)
adapters = st.none() | st.sampled_from(["lora-a", "lora-b"])


def _dumps(doc: object, ascii_only: bool) -> bytes:
    try:
        return json.dumps(doc, ensure_ascii=ascii_only).encode()
    except UnicodeEncodeError:
        return json.dumps(doc).encode()


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["ids", "prompt_ids", "text", "prompt", "prompts", "chat", "odd"]))
    if kind == "odd":
        return draw(
            st.sampled_from(
                [
                    b"",
                    b"not json",
                    b"[1, 2]",
                    b'{"input_ids": [1, -2, 3]}',
                    b'{"input_ids": [1, 4294967296]}',
                    b'{"input_ids": [1.0, 2]}',
                    b'{"input_ids": [true]}',
                    b'{"input_ids": [-0, 0, 1]}',
                    b'{"input_ids": [1, -Infinity, NaN], "prompt": [2, Infinity], "text": "ab"}',
                    b'{"input_ids": [1, 2], "input_ids": "x", "prompt": [3]}',
                    b'{"input_ids": [1, [2]], "prompt": [1, 2]}',
                    b'{"text": "ab", "text": "ba"}',
                    b'{"text": "\\ud800ab"}',
                    b'{"text": "ab"} trailing',
                    b'\xef\xbb\xbf{"text": "ab"}',
                    b'{"prompt": ["a", 1], "messages": [{"content": "ab"}]}',
                    b'{"messages": [{"content": "a", "content": [{"text": "b"}, 3]}, "x"]}',
                    b'{"model": "base:lora-a", "text": "ab"}',
                    b'{"model": "base", "lora_path": 3, "extra_key": 5, "text": "ab"}',
                ]
            )
        )
    doc: dict[str, Any] = {}
    if kind == "ids":
        doc["input_ids"] = draw(id_lists)
    elif kind == "prompt_ids":
        doc["prompt"] = draw(id_lists)
    elif kind == "text":
        doc["text"] = draw(texts)
    elif kind == "prompt":
        doc["prompt"] = draw(texts)
    elif kind == "prompts":
        doc["prompt"] = draw(st.lists(texts, max_size=3))
    else:
        content = st.one_of(
            texts, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}))
        )
        doc["messages"] = draw(
            st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": content}))
        )
    adapter = draw(adapters)
    if adapter is not None:
        if draw(st.booleans()):
            doc["lora_path"] = adapter
        else:
            doc["model"] = "base:" + adapter
    extra = draw(st.none() | st.sampled_from(["k1", "k2"]))
    if extra is not None:
        doc["extra_key"] = extra
    # Request ids with smg's lineage suffixes (sticky keys), odd ones and non-strings.
    rid = draw(st.none() | st.sampled_from(RIDS))
    if rid is not None:
        doc["rid"] = rid
    return _dumps(doc, draw(st.booleans()))


headers = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "X-SMG-Routing-Key",
                "x-smg-routing-key",
                "X-SMG-Target-Worker",
                "X-Session",
                "Authorization",
                "Cookie",
                "X-Other",
            ]
        ),
        st.sampled_from(
            ["", "k1", "k2", "k3", "0", "1", "3", "9", "x", "k1_t2", "k2_r1", "x" * 129]
        ),
    ),
    max_size=3,
)

ops = st.one_of(
    st.tuples(st.just("pick"), headers, bodies(), st.booleans()),
    st.tuples(st.just("finished"), st.integers(0, 4)),
    st.tuples(st.just("record"), st.integers(0, 4), headers, bodies()),
    st.tuples(st.just("prefilled"), st.integers(0, 4), headers, bodies()),
    # The engine of an earlier pick answers it (the n-th last one picked).
    st.tuples(st.just("answered"), st.integers(0, 4)),
    # An earlier pick's reply says its cached_tokens, against the belief at its pick (None)
    # or a made-up one large enough to drop units from the small trees drawn here.
    st.tuples(
        st.just("cached"),
        st.integers(0, 4),
        st.none() | st.sampled_from([0, 65, 70, 1000]),
        st.sampled_from([0, 1, 5, 1000]),
    ),
    st.tuples(st.just("load"), st.integers(0, 4), st.none() | st.integers(0, 20)),
    # GET /v1/loads reports: small figures so that scores tie; throughputs of 0 (unreported).
    st.tuples(
        st.just("loads"),
        st.integers(0, 4),
        st.none()
        | st.tuples(
            st.integers(0, 3),
            st.integers(0, 3),
            st.sampled_from([0, 1, 100, 1024, 5000]),
            st.sampled_from([0.0, 0.25, 0.5, 0.999, 1.0, 1.5]),
            st.sampled_from([0.0, 100.0, 1000.0, 1500.5]),
        ),
    ),
    st.tuples(st.just("health"), st.integers(0, 4), st.booleans()),
    st.tuples(st.just("evict"), st.floats(0, 100)),
)


@st.composite
def options(draw: st.DrawFn) -> dict[str, object]:
    return {
        "cache_threshold": draw(st.floats(0.0, 1.0)),
        "balance_abs_threshold": draw(st.integers(0, 4)),
        "balance_rel_threshold": draw(st.floats(0.0, 3.0)),
        "max_tree_size": draw(st.integers(0, 30)),
        "assignment_mode": draw(st.sampled_from(["random", "min_load", "min_group"])),
        "max_idle_secs": draw(st.integers(0, 30)),
        "tie_break": draw(st.sampled_from(["index", "round_robin"])),
        "seed": draw(st.integers(0, (1 << 64) - 1)),
        "least_load_kv_pressure_weight": draw(st.sampled_from([0.0, 0.15, 1.0])),
        "least_load_default_throughput": draw(st.sampled_from([1.0, 2000.0])),
        "least_load_mean_prefill_tokens": draw(st.sampled_from([1, 3, 1024])),
        "least_load_max_waiting_requests": draw(st.integers(0, 3)),
        "power_of_two_load_metric": draw(
            st.sampled_from(["expected_wait", "requests", "least_requests"])
        ),
        "prefix_token_count": draw(st.integers(1, 6)),
        "prefix_hash_load_factor": draw(st.floats(1.0, 3.0)),
        "prefix_hash_balance_abs_threshold": draw(st.integers(0, 3)),
        "sticky_sessions": draw(st.booleans()),
        "worker_overload_protection": draw(st.booleans()),
        "worker_overload_waiting_requests": draw(st.integers(1, 3)),
        "worker_overload_token_usage": draw(st.sampled_from([0.25, 0.5, 1.0])),
        "routing_key_headers": draw(
            st.sampled_from([["x-smg-routing-key"], ["X-Session", "x-smg-routing-key"]])
        ),
    }


@pytest.mark.parametrize("name", POLICIES)
@SETTINGS
@given(engines=st.integers(1, 5), opts=options(), script=st.lists(ops, max_size=60))
def test_rust_and_python_pick_alike(
    name: str, engines: int, opts: dict[str, object], script: list[tuple[Any, ...]]
) -> None:
    urls = URLS[:engines]
    rust, py = RUST(name, urls, opts), PY(name, urls, opts)
    clock = 0.0
    running: list[tuple[int, str | None]] = []  # requests started, with their sticky keys
    answers: list[tuple[int, Any, bytes]] = []  # every pick: engine, headers, body
    beliefs: list[int | None] = []  # every pick's `held` of its engine
    for op in script:
        if op[0] == "cached":
            if answers:
                back = -1 - op[1] % len(answers)
                engine, hdrs, body = answers[back]
                held = beliefs[back] if op[2] is None else op[2]
                if held is not None:
                    rust.cached(engine, hdrs, body, held, op[3])
                    py.cached(engine, hdrs, body, held, op[3])
                    assert rust.held(engine, hdrs, body) == py.held(engine, hdrs, body)
            continue
        if op[0] == "answered":
            if answers:
                engine, hdrs, body = answers[-1 - op[1] % len(answers)]
                rust.prefilled(engine, hdrs, body)
                py.prefilled(engine, hdrs, body)
            continue
        if op[0] == "pick":
            _, hdrs, body, start = op
            assert rust.sticky_key(hdrs, body) == py.sticky_key(hdrs, body), (hdrs, body)
            picked, key = rust.pick_keyed(hdrs, body)
            assert (picked, key) == py.pick_keyed(hdrs, body), (hdrs, body)
            assert 0 <= picked < engines
            answers.append((picked, hdrs, body))
            beliefs.append(rust.held(picked, hdrs, body))
            assert beliefs[-1] == py.held(picked, hdrs, body)
            if start:
                rust.started(picked, key)
                py.started(picked, key)
                running.append((picked, key))
        elif op[1] >= engines:
            continue
        elif op[0] == "finished":
            ended = next((r for r in running if r[0] == op[1]), (op[1], None))
            if ended in running:
                running.remove(ended)
            rust.finished(op[1], None, ended[1])
            py.finished(op[1], None, ended[1])
        elif op[0] == "record":
            rust.record(op[1], op[2], op[3])
            py.record(op[1], op[2], op[3])
        elif op[0] == "prefilled":
            rust.prefilled(op[1], op[2], op[3])
            py.prefilled(op[1], op[2], op[3])
        elif op[0] == "load":
            rust.set_load(op[1], op[2])
            py.set_load(op[1], op[2])
        elif op[0] == "loads":
            rust.set_loads(op[1], op[2])
            py.set_loads(op[1], op[2])
        elif op[0] == "health":
            rust.set_healthy(op[1], op[2])
            py.set_healthy(op[1], op[2])
        else:
            clock += op[1]
            rust.evict(clock)
            py.evict(clock)
        assert rust.in_flight == py.in_flight


def test_options_reach_rust_exactly() -> None:
    # A cache threshold one ulp below 1: a whole-prompt match is over it. Read one ulp off
    # (serde_json without float_roundtrip made it 1.0), Rust took the other engine.
    opts = {"cache_threshold": 0.9999999999999999, "balance_abs_threshold": 0}
    rust = RUST("cache_aware_gateway", URLS[:2], opts)
    py = PY("cache_aware_gateway", URLS[:2], opts)
    body = b'{"text": "a"}'
    assert [rust.pick([], body) for _ in range(2)] == [py.pick([], body) for _ in range(2)]


@pytest.mark.parametrize("impl", [RUST, PY], ids=["rust", "python"])
def test_bad_options_are_value_errors(impl: Any) -> None:
    for name, opts in [
        ("nope", {}),
        ("cache_aware", {"cache_threshold": 1.5}),
        ("cache_aware", {"unknown": 1}),
        ("manual", {"assignment_mode": "sideways"}),
        ("least_in_flight", {"tie_break": "coin"}),
        ("cache_aware", {"max_tree_size": -1}),
    ]:
        with pytest.raises(ValueError):
            impl(name, URLS[:2], opts)
    with pytest.raises(ValueError):
        impl("round_robin", [], {})
    policy = impl("round_robin", URLS[:2])
    for index in (2, -1):
        with pytest.raises(IndexError):
            policy.started(index)
        with pytest.raises(IndexError):
            policy.set_healthy(index, False)
    with pytest.raises(ValueError):
        policy.set_load(0, -1)

"""Sticky keys (`--sticky-sessions`): smg 1.13's rules, in both twins.

The key rules are smg's (`policies/registry.rs` of smg-project/smg: the rid with one `_r<n>`
then one `_t<n>` stripped, else the first routing-key header with 1 to 128 bytes of UTF-8,
stripped alike; a key with 2 requests in flight on its engine spills); the pick-heavy
property below drives both twins through the same keyed requests, completions and trims.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessiongate.engines.policy import get_engine_policy
from sessiongate.engines.policy.sticky import strip_lineage

TWINS = {"rust": get_engine_policy("rust"), "python": get_engine_policy("python")}
URLS = ["http://e0:1", "http://e1:2", "http://e2:3"]


def body(rid: object = None, text: str = "hello") -> bytes:
    doc: dict[str, object] = {"text": text}
    if rid is not None:
        doc["rid"] = rid
    return json.dumps(doc).encode()


def sticky(twin: str, policy: str = "round_robin", **options: object) -> Any:
    return TWINS[twin](policy, URLS, {"sticky_sessions": True, "seed": 7, **options})


@pytest.mark.parametrize(
    ("rid", "key"),
    [
        ("conv_t2_r1", "conv"),
        ("conv_t3", "conv"),
        ("conv_r1", "conv"),
        ("conv", "conv"),
        ("conv_r1_t2", "conv_r1"),  # one _r<n> first, then one _t<n>: not the other way
        ("conv_t2_t3", "conv_t2"),
        ("conv_t", "conv_t"),
        ("conv_tx", "conv_tx"),
        ("_t1", "_t1"),  # nothing but suffixes: the rid itself
        ("x" * 128 + "_t9", "x" * 128),
    ],
)
def test_rid_lineage(rid: str, key: str) -> None:
    assert strip_lineage(rid) == key
    for twin in TWINS:
        assert sticky(twin).sticky_key([], body(rid)) == key


@pytest.mark.parametrize("twin", TWINS)
def test_where_the_key_comes_from(twin: str) -> None:
    policy = sticky(twin, routing_key_headers=["X-Session", "x-smg-routing-key"])
    # The rid wins over the headers.
    assert policy.sticky_key([("x-session", "h")], body("conv_t1")) == "conv"
    # Without a rid: the first configured header with a valid value, stripped alike.
    assert policy.sticky_key([("X-Session", "h_t2")], body()) == "h"
    assert policy.sticky_key([("x-smg-routing-key", "g")], body()) == "g"
    assert policy.sticky_key([("x-session", "x" * 129), ("x-smg-routing-key", "g")], body()) == "g"
    # No key: none of them, an empty or oversized value, a rid that is no string, sticky off.
    assert policy.sticky_key([("x-other", "h")], body()) is None
    assert policy.sticky_key([("x-session", "")], body()) is None
    assert policy.sticky_key([], body("x" * 129)) is None
    assert policy.sticky_key([], body(7)) is None
    assert policy.sticky_key([], b"not json") is None
    assert TWINS[twin]("round_robin", URLS).sticky_key([], body("conv")) is None


@pytest.mark.parametrize("twin", TWINS)
def test_a_key_stays_on_its_first_engine(twin: str) -> None:
    policy = sticky(twin)  # round robin underneath: without the pin, picks would rotate
    first, key = policy.pick_keyed([], body("conv_t1"))
    assert key == "conv"
    for turn in range(2, 8):
        assert policy.pick_keyed([], body(f"conv_t{turn}")) == (first, "conv")
    others = {policy.pick_keyed([], body(f"other{i}"))[0] for i in range(3)}
    assert len(others) > 1  # unkeyed and new keys still follow the policy


@pytest.mark.parametrize("twin", TWINS)
def test_a_key_with_two_in_flight_spills_and_moves_only_when_the_spill_is_free(
    twin: str,
) -> None:
    policy = sticky(twin)
    home, key = policy.pick_keyed([], body("conv_t1"))
    policy.started(home, key)
    assert policy.pick_keyed([], body("conv_t2"))[0] == home
    policy.started(home, key)
    # Two of the key's requests in flight at home: the third goes where the policy picks,
    # and the pin follows it there (the key has nothing in flight on that engine).
    spill, _ = policy.pick_keyed([], body("conv_t3"))
    assert spill != home
    policy.started(spill, key)
    policy.finished(home, None, key)
    policy.finished(home, None, key)
    assert policy.pick_keyed([], body("conv_t4"))[0] == spill
    # Requests of another key do not count against this one.
    policy.started(spill, "other")
    policy.started(spill, "other")
    assert policy.pick_keyed([], body("conv_t5"))[0] == spill


@pytest.mark.parametrize("twin", TWINS)
def test_a_pin_on_a_down_engine_is_placed_again(twin: str) -> None:
    policy = sticky(twin)
    home, _ = policy.pick_keyed([], body("conv"))
    policy.set_healthy(home, False)
    moved, _ = policy.pick_keyed([], body("conv_t2"))
    assert moved != home
    policy.set_healthy(home, True)
    assert policy.pick_keyed([], body("conv_t3"))[0] == moved


@pytest.mark.parametrize("twin", TWINS)
def test_idle_keys_are_forgotten(twin: str) -> None:
    policy = sticky(twin, max_idle_secs=10)
    home, _ = policy.pick_keyed([], body("conv"))
    policy.evict(5.0)
    assert policy.pick_keyed([], body("conv_t2"))[0] == home  # used at 5 s
    policy.evict(14.0)
    assert policy.pick_keyed([], body("conv_t3"))[0] == home  # 9 s idle: kept, used at 14
    policy.evict(24.0)  # 10 s idle: forgotten; round robin places it afresh
    placed = [policy.pick_keyed([], body("conv_t4"))[0]]
    placed += [policy.pick_keyed([], body(f"n{i}"))[0] for i in range(2)]
    assert sorted(placed) == [0, 1, 2]


@pytest.mark.parametrize("twin", TWINS)
@pytest.mark.parametrize("policy", ["manual", "consistent_hashing"])
def test_policies_with_their_own_key_are_left_alone(twin: str, policy: str) -> None:
    assert sticky(twin, policy).sticky_key([], body("conv")) is None


@pytest.mark.parametrize("twin", TWINS)
def test_header_names_must_be_http_tokens(twin: str) -> None:
    with pytest.raises(ValueError, match='routing_key_headers: "x session" is not an HTTP header'):
        sticky(twin, routing_key_headers=["x session"])


keyed_ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("pick"),
            st.sampled_from(["a", "a_t1", "a_t2_r1", "b_t1", "c", None]),
            st.sampled_from(["p", "pq", "x"]),
            st.booleans(),
        ),
        st.tuples(st.just("finished"), st.integers(0, 20)),
        st.tuples(st.just("health"), st.integers(0, 2), st.booleans()),
        st.tuples(st.just("evict"), st.integers(0, 8).map(float)),
    ),
    max_size=80,
)


@pytest.mark.parametrize(
    "policy", ["round_robin", "cache_aware", "least_load", "prefix_hash", "power_of_two"]
)
@settings(max_examples=100, deadline=None)
@given(script=keyed_ops, idle=st.integers(0, 10))
def test_twins_pick_alike_under_keyed_traffic(
    policy: str, script: list[tuple[Any, ...]], idle: int
) -> None:
    rust, py = (
        sticky("rust", policy, max_idle_secs=idle),
        sticky("python", policy, max_idle_secs=idle),
    )
    running: list[tuple[int, str | None]] = []
    clock = 0.0
    for op in script:
        if op[0] == "pick":
            request = body(op[1], op[2])
            picked = rust.pick_keyed([], request)
            assert picked == py.pick_keyed([], request)
            if op[3]:
                rust.started(*picked)
                py.started(*picked)
                running.append(picked)
        elif op[0] == "finished" and running:
            index, key = running.pop(op[1] % len(running))
            rust.finished(index, None, key)
            py.finished(index, None, key)
        elif op[0] == "health":
            rust.set_healthy(op[1], op[2])
            py.set_healthy(op[1], op[2])
        elif op[0] == "evict":
            clock += op[1]
            rust.evict(clock)
            py.evict(clock)
        assert rust.in_flight == py.in_flight

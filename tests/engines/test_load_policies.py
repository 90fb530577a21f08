"""least_load, power_of_two on the expected wait, and prefix_hash (smg 1.13's load-aware
policies): their documented behaviour, on both implementations."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from sessiongate.engines.policy import LoadReport, get_engine_policy

IMPLS = pytest.mark.parametrize(
    "impl", [get_engine_policy("rust"), get_engine_policy("python")], ids=["rust", "python"]
)
URLS = ["http://e0:1", "http://e1:2", "http://e2:3", "http://e3:4"]


def body(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def idle(throughput: float = 1000.0) -> LoadReport:
    return LoadReport(0, 0, 0, 0.0, throughput)


@IMPLS
def test_least_load_follows_queued_tokens_and_kv_pressure(impl: Any) -> None:
    policy = impl("least_load", URLS[:3], {"seed": 1})
    policy.set_loads(0, LoadReport(4, 2, 8000, 0.2, 1000.0))  # 8 s of queue
    policy.set_loads(1, LoadReport(4, 0, 1000, 0.2, 1000.0))  # 1 s
    policy.set_loads(2, LoadReport(1, 0, 0, 0.95, 1000.0))  # idle but KV nearly full: 2.85 s
    assert policy.pick([], body(input_ids=[1] * 100)) == 1


@IMPLS
def test_least_load_credits_each_pick_until_the_next_report(impl: Any) -> None:
    policy = impl("least_load", URLS[:2], {"seed": 1, "least_load_mean_prefill_tokens": 1000})
    policy.set_loads(0, idle())
    policy.set_loads(1, LoadReport(0, 0, 1500, 0.0, 1000.0))
    # Without ids a request counts as 1000 tokens: 0 -> 1 s, then 1 (1.5 s) < 0 (2 s).
    picks = [policy.pick([], b"{}") for _ in range(4)]
    assert picks == [0, 0, 1, 0]
    policy.set_loads(0, idle())  # a fresh report: the credit starts over
    assert policy.pick([], b"{}") == 0


@IMPLS
def test_least_load_queue_without_tokens_counts_mean_prefill(impl: Any) -> None:
    policy = impl("least_load", URLS[:2], {"seed": 1})
    policy.set_loads(0, LoadReport(0, 8, 0, 0.0, 1000.0))  # 8 x 1024 tokens queued
    policy.set_loads(1, LoadReport(0, 0, 2000, 0.0, 1000.0))
    assert policy.pick([], b"{}") == 1


@IMPLS
def test_least_load_dark_fleet_is_join_shortest_queue(impl: Any) -> None:
    policy = impl("least_load", URLS[:3], {"seed": 5})
    policy.started(0)
    policy.started(1)
    assert policy.pick([], b"{}") == 2
    # Ties go at random among the tied (uniformly, not to the first).
    fresh = impl("least_load", URLS[:3], {"seed": 5})
    assert set(Counter(fresh.pick([], b"{}") for _ in range(60))) == {0, 1, 2}


@IMPLS
def test_least_load_engine_without_report_scored_on_in_flight(impl: Any) -> None:
    policy = impl("least_load", URLS[:2], {"seed": 1})
    policy.set_loads(0, LoadReport(0, 0, 3000, 0.0, 1000.0))  # 3 s
    policy.started(1)
    policy.started(1)  # 2 x 1024 / 1000 = 2.048 s
    assert policy.pick([], b"{}") == 1
    policy.started(1)  # 3.072 s
    assert policy.pick([], b"{}") == 0


@IMPLS
def test_least_load_waiting_cap(impl: Any) -> None:
    policy = impl("least_load", URLS[:2], {"seed": 1, "least_load_max_waiting_requests": 2})
    policy.set_loads(0, LoadReport(0, 1, 0, 0.0, 1000.0))
    policy.set_loads(1, LoadReport(0, 0, 50_000, 0.0, 1000.0))
    assert policy.pick([], body(input_ids=[1])) == 0  # 1 waiting + 0 sent < 2
    assert policy.pick([], body(input_ids=[1])) == 1  # 1 + 1 reached the cap
    policy.set_loads(1, LoadReport(0, 5, 0, 0.0, 1000.0))  # both capped: the score decides
    assert policy.pick([], body(input_ids=[1])) == 0


@IMPLS
def test_power_of_two_expected_wait_once_loads_are_known(impl: Any) -> None:
    policy = impl("power_of_two", URLS[:2], {"seed": 7})
    policy.set_loads(0, LoadReport(0, 0, 90_000, 0.5, 1000.0))
    policy.set_loads(1, idle())
    assert policy.pick([], b"{}") == 1
    least = impl(
        "power_of_two", URLS[:2], {"seed": 7, "power_of_two_load_metric": "least_requests"}
    )
    least.set_loads(0, LoadReport(0, 0, 90_000, 0.5, 1000.0))
    least.started(1)
    assert {least.pick([], b"{}") for _ in range(10)} == {0}
    requests = impl("power_of_two", URLS[:2], {"seed": 7, "power_of_two_load_metric": "requests"})
    requests.set_loads(0, LoadReport(3, 3, 0, 0.0, 1000.0))
    requests.set_loads(1, LoadReport(1, 0, 0, 0.9, 1000.0))
    assert requests.pick([], b"{}") == 1


@IMPLS
def test_prefix_hash_groups_prefixes_and_passes_overloaded_engines(impl: Any) -> None:
    policy = impl("prefix_hash", URLS, {"prefix_token_count": 4})
    head = [7, 8, 9, 10]
    targets = {policy.pick([], body(input_ids=[*head, n])) for n in range(20)}
    assert len(targets) == 1  # only the first 4 ids count
    target = targets.pop()
    spread = Counter(policy.pick([], body(input_ids=[n, n, n, n])) for n in range(400))
    assert len(spread) == 4 and min(spread.values()) > 40
    # Load the target past max(1.25 x avg, avg + 10), avg = (14 + 1) / 4: the next engine on
    # the ring takes over (13 would not be: 13 <= 3.5 + 10).
    for _ in range(13):
        policy.started(target)
    assert policy.pick([], body(input_ids=head)) == target
    for _ in range(1):
        policy.started(target)
    moved = policy.pick([], body(input_ids=head))
    assert moved != target
    assert policy.pick([], body(input_ids=head)) == moved
    # An engine down is passed over the same way: its keys go to the next on the ring.
    policy.set_healthy(target, False)
    assert policy.pick([], body(input_ids=head)) == moved


@IMPLS
def test_prefix_hash_text_routing_key_and_keyless(impl: Any) -> None:
    policy = impl("prefix_hash", URLS, {"prefix_token_count": 2})
    # 2 tokens = 8 characters of text.
    a = policy.pick([], body(text="abcdefgh-one"))
    assert policy.pick([], body(messages=[{"role": "user", "content": "abcdefgh-two"}])) == a
    key = [("X-SMG-Routing-Key", "tenant-9")]
    assert len({policy.pick(key, body(text=f"{n} other")) for n in range(10)}) == 1
    policy.started(0)
    assert policy.pick([], b"not json") == 1  # nothing to hash: fewest in flight


@IMPLS
def test_load_reports_are_checked(impl: Any) -> None:
    policy = impl("least_load", URLS[:2])
    for bad in [(0, -1, 0, 0.0, 1.0), (0, 0, 0, float("nan"), 1.0), (0, 0, 0, 0.0, -1.0), (1, 2)]:
        with pytest.raises((ValueError, TypeError)):
            policy.set_loads(0, bad)
    with pytest.raises(IndexError):
        policy.set_loads(2, None)
    policy.set_loads(0, (0, 0, 0, 0, 1000))  # integers are numbers too
    policy.set_loads(0, None)

"""The documented behaviour of each engine routing policy, on both implementations."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from sessiongate.engines.policy import get_engine_policy
from sessiongate.engines.policy.base import key_material

IMPLS = pytest.mark.parametrize(
    "impl", [get_engine_policy("rust"), get_engine_policy("python")], ids=["rust", "python"]
)
URLS = ["http://e0:1", "http://e1:2", "http://e2:3", "http://e3:4"]


def body(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def send(
    policy: Any, n: int, payload: bytes, headers: tuple[tuple[str, str], ...] = ()
) -> list[int]:
    """`n` concurrent requests: each picked and left in flight."""
    picks = []
    for _ in range(n):
        picks.append(policy.pick(list(headers), payload))
        policy.started(picks[-1])
    return picks


@IMPLS
def test_round_robin_skips_unhealthy_engines(impl: Any) -> None:
    policy = impl("round_robin", URLS[:3])
    assert [policy.pick([], b"") for _ in range(4)] == [0, 1, 2, 0]
    policy.set_healthy(1, False)
    assert {policy.pick([], b"") for _ in range(4)} == {0, 2}
    for i in range(3):
        policy.set_healthy(i, False)
    assert {policy.pick([], b"") for _ in range(3)} == {0, 1, 2}  # none healthy: all


@IMPLS
@pytest.mark.parametrize("name", ["cache_aware", "cache_aware_gateway"])
def test_a_grpo_group_lands_on_one_engine(impl: Any, name: str) -> None:
    policy = impl(name, URLS)
    group = body(input_ids=list(range(500)), sampling_params={"n": 1})
    assert len(set(send(policy, 16, group))) == 1
    # The next group (another prompt) goes to an engine with an empty tree.
    first = policy.pick([], group)
    other = send(policy, 16, body(input_ids=list(range(1000, 1500))))
    assert len(set(other)) == 1 and other[0] != first


@IMPLS
def test_multi_turn_agents_follow_their_prefix(impl: Any) -> None:
    policy = impl("cache_aware", URLS[:2])
    turn1 = [{"role": "user", "content": "agent A " + "x" * 50}]
    a = send(policy, 1, body(messages=turn1))[0]
    b = send(policy, 1, body(messages=[{"role": "user", "content": "agent B " + "y" * 50}]))[0]
    assert a != b
    turn2 = [*turn1, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]
    assert policy.pick([], body(messages=turn2)) == a


@IMPLS
@pytest.mark.parametrize("name", ["cache_aware", "cache_aware_gateway"])
def test_imbalance_falls_back_to_the_least_loaded(impl: Any, name: str) -> None:
    policy = impl(name, URLS[:2], {"balance_abs_threshold": 4, "balance_rel_threshold": 1.5})
    prompt = body(input_ids=list(range(100)))
    assert send(policy, 5, prompt) == [0] * 5  # balanced until 5 - 0 > 4 and 5 > 0 * 1.5
    assert policy.pick([], prompt) == 1


@IMPLS
def test_adapters_and_extra_keys_do_not_share_trees(impl: Any) -> None:
    policy = impl("cache_aware", URLS[:2])
    ids = list(range(300))
    a = send(policy, 1, body(input_ids=ids, lora_path="a"))[0]
    assert send(policy, 1, body(input_ids=ids, lora_path="b"))[0] != a
    policy = impl("cache_aware", URLS[:2])
    a = send(policy, 1, body(input_ids=ids, extra_key="k1"))[0]
    assert send(policy, 1, body(input_ids=ids, extra_key="k2"))[0] != a
    # The Gateway's variant keeps one tree: the same prompt follows its cache.
    policy = impl("cache_aware_gateway", URLS[:2])
    a = send(policy, 1, body(input_ids=ids, lora_path="a"))[0]
    assert send(policy, 1, body(input_ids=ids, lora_path="b"))[0] == a


@IMPLS
def test_equal_matches_spread_by_load(impl: Any) -> None:
    """Both engines hold a shared system prompt: requests extending it spread over them by
    requests in flight instead of piling onto one."""
    system = body(text="You are a careful assistant. " * 4)
    # Questions that part from each other right after the system prompt.
    questions = [body(text="You are a careful assistant. " * 4 + f"{i}?") for i in range(6)]
    policy = impl("cache_aware", URLS[:2])
    for down in (1, 0):  # the prompt reaches each engine while the other is down
        policy.set_healthy(down, False)
        policy.pick([], system)
        policy.set_healthy(down, True)
    assert [send(policy, 1, q)[0] for q in questions] == [0, 1, 0, 1, 0, 1]
    # The Gateway's variant sends a request whose prefix holder is down to its first healthy
    # engine without recording it, so the prompt stays on one engine, and so does the rest.
    gateway = impl("cache_aware_gateway", URLS[:2])
    for down in (1, 0):
        gateway.set_healthy(down, False)
        gateway.pick([], system)
        gateway.set_healthy(down, True)
    assert {send(gateway, 1, q)[0] for q in questions} == {0}


@IMPLS
def test_a_shared_system_prompt_does_not_pull_every_group_to_one_engine(impl: Any) -> None:
    """GRPO: sixteen groups whose prompts share a system prompt, their samples interleaved
    and all in flight. cache_aware keeps each group on one engine and spreads the groups
    over every engine (an engine's cost counts the work it already has); the Gateway's rule
    follows the shared system prompt while in-flight counts differ by 64 or less, so eight
    groups (64 requests) pile up on one."""
    system = list(range(600))
    groups = [body(input_ids=system + list(range(1000 * g, 1000 * g + 700))) for g in range(1, 17)]
    for name, count in [("cache_aware", 16), ("cache_aware_gateway", 8)]:
        policy = impl(name, URLS)
        picks: dict[int, set[int]] = {g: set() for g in range(count)}
        for _ in range(8):
            for g, prompt in enumerate(groups[:count]):
                picks[g] |= set(send(policy, 1, prompt))
        assert all(len(p) == 1 for p in picks.values()), (name, picks)
        per_engine = Counter(next(iter(p)) for p in picks.values())
        if name == "cache_aware":
            assert len(per_engine) == 4 and max(per_engine.values()) <= 6, per_engine
        else:
            assert len(per_engine) == 1, per_engine


@IMPLS
def test_a_backlog_outweighs_a_cached_prefix_until_it_drains(impl: Any) -> None:
    """The engine holding a prompt is left while the work it has in flight exceeds what the
    prompt costs to prefill four times elsewhere, and is chosen again once that work has ended."""
    policy = impl("cache_aware", URLS[:2])
    prompt = body(input_ids=list(range(100)))
    home = send(policy, 1, prompt)[0]
    other = 1 - home
    policy.finished(home)
    policy.set_healthy(other, False)  # a backlog of 2 x 1,000 units lands on `home`
    send(policy, 2, body(input_ids=list(range(10_000, 11_000))))
    send(policy, 1, body(input_ids=list(range(20_000, 20_150))))
    policy.set_healthy(other, True)
    # home: 2 x 1,001 + 151 units in flight; other: 4 x 100 to prefill the prompt again.
    assert policy.pick([], prompt) == other
    policy.finished(home)
    policy.finished(home)  # one request left on `home`, counted at the mean: 718 units
    assert policy.pick([], prompt) == other
    policy.finished(home)
    assert policy.in_flight == [0, 0]
    assert policy.pick([], prompt) == home  # nothing in flight: the cache decides


@IMPLS
def test_a_recorded_request_teaches_cache_aware_as_a_pick_would(impl: Any) -> None:
    """A pinned session family's turn is no pick, but recorded: its prompt joins the
    engine's tree (a stateless request sharing it follows once the engine answered it) and
    its prefill counts as work in flight there (an unrelated prompt goes elsewhere)."""
    policy = impl("cache_aware", URLS[:2])
    turn = body(input_ids=list(range(400)))
    policy.record(1, [], turn)
    policy.started(1)
    policy.prefilled(1, [], turn)
    assert policy.pick([], body(input_ids=[*range(400), 7, 8])) == 1
    assert policy.pick([], body(input_ids=list(range(5000, 5100)))) == 0  # 401 units on 1
    for name in ("round_robin", "least_in_flight", "manual"):
        other = impl(name, URLS[:2])
        other.record(1, [], turn)  # kept nothing of it
        other.prefilled(1, [], turn)
    with pytest.raises(IndexError):
        policy.record(2, [], turn)


@IMPLS
def test_token_ids_match_as_ids(impl: Any) -> None:
    """[12, 3] and [123] share no token; the Gateway's decimal text "12 3"/"123" shares "12"."""
    for name, same in [("cache_aware", False), ("cache_aware_gateway", True)]:
        policy = impl(name, URLS[:2], {"cache_threshold": 0.4})
        a = send(policy, 1, body(input_ids=[123, 4]))[0]
        assert (send(policy, 1, body(input_ids=[12, 3]))[0] == a) == same, name


@IMPLS
def test_eviction_trims_the_trees(impl: Any) -> None:
    policy = impl("cache_aware", URLS[:2], {"max_tree_size": 0})
    a = send(policy, 1, body(input_ids=list(range(50))))[0]
    policy.finished(a)
    policy.evict(60.0)
    # Both trees are empty again: the smallest-tree tie goes to the lowest index.
    assert policy.pick([], body(input_ids=list(range(50)))) == 0


@IMPLS
def test_least_in_flight_ties(impl: Any) -> None:
    policy = impl("least_in_flight", URLS[:3])
    assert send(policy, 4, b"") == [0, 1, 2, 0]
    policy.finished(1)
    assert policy.pick([], b"") == 1
    rotating = impl("least_in_flight", URLS[:3], {"tie_break": "round_robin"})
    assert [rotating.pick([], b"") for _ in range(3)] == [0, 1, 2]


@IMPLS
def test_power_of_two_prefers_the_lighter_reported_load(impl: Any) -> None:
    policy = impl("power_of_two", URLS[:2], {"seed": 7})
    policy.set_load(0, 100)
    assert {policy.pick([], b"") for _ in range(20)} == {1}
    policy.set_load(0, None)  # unknown again: in flight (0 each) decides, ties to the first drawn
    assert {policy.pick([], b"") for _ in range(40)} == {0, 1}


@IMPLS
def test_seeded_random_policies_repeat(impl: Any) -> None:
    for name in ("random", "power_of_two"):
        one, two = impl(name, URLS, {"seed": 3}), impl(name, URLS, {"seed": 3})
        assert [one.pick([], b"") for _ in range(30)] == [two.pick([], b"") for _ in range(30)]


@IMPLS
@pytest.mark.parametrize("mode", ["random", "min_load", "min_group"])
def test_manual_keys_are_sticky(impl: Any, mode: str) -> None:
    policy = impl("manual", URLS[:3], {"assignment_mode": mode, "seed": 1})
    key = [("X-SMG-Routing-Key", "session-1")]
    first = policy.pick(key, b"")
    assert {policy.pick(key, b"") for _ in range(10)} == {first}
    policy.set_healthy(first, False)
    moved = policy.pick(key, b"")
    assert moved != first
    policy.set_healthy(first, True)
    assert policy.pick(key, b"") == first  # the older engine, healthy again, comes first
    if mode == "min_group":
        # The key's latest engine counts it; new keys fill the other two first.
        others = {policy.pick([("x-smg-routing-key", f"k{i}")], b"") for i in range(2)}
        assert moved not in others


@IMPLS
def test_manual_forgets_idle_keys(impl: Any) -> None:
    policy = impl("manual", URLS[:3], {"assignment_mode": "min_load", "max_idle_secs": 10})
    key = [("x-smg-routing-key", "k")]
    first = policy.pick(key, b"")
    policy.started(first)
    policy.evict(5.0)
    policy.evict(10.0)  # last used at 0: forgotten; min_load avoids the busy engine now
    assert policy.pick(key, b"") != first


@IMPLS
def test_consistent_hashing(impl: Any) -> None:
    policy = impl("consistent_hashing", URLS)
    picks = {policy.pick([("X-SMG-Routing-Key", f"user-{i}")], b"") for i in range(40)}
    assert len(picks) > 1
    key = [("X-SMG-Routing-Key", "user-1")]
    home = policy.pick(key, b"")
    assert policy.pick([("Authorization", "user-1")], b"") == home  # the implicit key
    policy.set_healthy(home, False)
    assert policy.pick(key, b"") != home
    assert policy.pick([("x-smg-target-worker", "2")], b"") == 2


def test_key_material() -> None:
    m = key_material(body(input_ids=[1, 2], text="t", lora_path="l", extra_key="k"))
    assert (m.ids, m.text, m.adapter, m.extra_key) == ([1, 2], "t", "l", "k")
    assert key_material(body(prompt=[5, 6])).ids == [5, 6]
    assert key_material(body(prompt=["a", "b"])).text == "a b"
    chat = body(messages=[{"content": "s"}, {"content": [{"type": "text", "text": "u"}]}])
    assert key_material(chat).text == "s u"
    assert key_material(body(model="base:lora")).adapter == "base:lora"
    assert key_material(body(model="base")).adapter is None
    assert key_material(b"nope").text == ""


@IMPLS
def test_cache_aware_counts_a_prefix_once_an_engine_answered_it(impl: Any) -> None:
    """A prefix sent to an engine is in no cache until the engine computes it: a request
    sharing only that prefix is placed by the work in flight until the engine answered a
    request carrying it; the whole prompt (a sibling) follows at once."""
    policy = impl("cache_aware", URLS[:2])
    system = list(range(400))
    first = body(input_ids=[*system, *range(5000, 5100)])
    assert send(policy, 1, first)[0] == 0
    second = body(input_ids=[*system, *range(6000, 6100)])
    assert policy.pick([], second) == 1, "the shared prefix is only sent: spread"
    assert policy.pick([], first) == 0, "the whole prompt: its sibling follows"
    policy.prefilled(0, [], first)
    third = body(input_ids=[*system, *range(7000, 7100)])
    assert policy.pick([], third) == 0, "answered: the prefix is held there"
    with pytest.raises(IndexError):
        policy.prefilled(2, [], first)


def _answered(policy: Any, ids: list[int]) -> int:
    """One request picked, answered with its prompt prefilled, and finished."""
    payload = body(input_ids=ids)
    engine: int = policy.pick([], payload)
    policy.started(engine)
    policy.prefilled(engine, [], payload)
    policy.finished(engine)
    return engine


@IMPLS
def test_cache_aware_forgets_what_a_reply_shows_the_engine_lost(impl: Any) -> None:
    """A reply whose cached_tokens falls more than 64 short of what the engine was believed
    to hold at the pick: the engine lost that much, and as many of its least recently used
    units leave the tree, never the answered prompt's own."""
    policy = impl("cache_aware", URLS[:2])
    shared = list(range(1000))
    older, newer = [*shared, *range(5000, 6000)], [*shared, *range(7000, 8000)]
    assert [_answered(policy, ids) for ids in (shared, list(range(20000, 21000)))] == [0, 1]
    assert [_answered(policy, ids) for ids in (older, newer)] == [0, 0]
    again = body(input_ids=[*newer, *range(9000, 9050)])
    assert policy.pick([], again) == 0
    held = policy.held(0, [], again)
    assert held == 2000
    policy.started(0)
    assert policy.held(0, [], body(input_ids=older)) == 2000
    # Within the slack (the prompt's last token, a page): nothing is forgotten.
    policy.cached(0, [], again, held, held - 64)
    assert policy.held(0, [], body(input_ids=older)) == 2000
    policy.cached(0, [], again, held, 0)
    policy.prefilled(0, [], again)
    policy.finished(0)
    assert policy.held(0, [], body(input_ids=older)) == 1000, "the oldest branch went"
    assert policy.held(0, [], again) == 2050, "the answered prompt stays"


@IMPLS
def test_cache_aware_keeps_the_prompt_an_engine_lost_and_computed_again(impl: Any) -> None:
    policy = impl("cache_aware", URLS[:2])
    prompt = list(range(3000))
    assert _answered(policy, prompt) == 0
    longer = body(input_ids=[*prompt, *range(9000, 9100)])
    assert policy.pick([], longer) == 0
    policy.cached(0, [], longer, 3000, 0)
    policy.prefilled(0, [], longer)
    assert policy.held(0, [], longer) == 3100


@IMPLS
def test_cache_aware_learns_from_cached_tokens_on_token_ids_only(impl: Any) -> None:
    """cached_tokens counts tokens: a tree of text (characters) holds no such figure, and
    other policies keep no tree."""
    policy = impl("cache_aware", URLS[:2])
    assert policy.held(0, [], body(text="hello")) is None
    assert policy.held(1, [], body(input_ids=[1, 2])) == 0
    assert impl("round_robin", URLS[:2]).held(0, [], body(input_ids=[1, 2])) is None
    assert impl("cache_aware_gateway", URLS[:2]).held(0, [], body(input_ids=[1])) is None
    with pytest.raises(ValueError, match="cached_tokens must be >= 0, got -1"):
        policy.cached(0, [], body(input_ids=[1]), 5, -1)
    with pytest.raises(ValueError, match="held must be >= 0, got -2"):
        policy.cached(0, [], body(input_ids=[1]), -2, 0)
    with pytest.raises(IndexError):
        policy.held(2, [], body(input_ids=[1]))

"""Siblings (engines/siblings.py): which requests share a prompt, the warm-up they get, the
lead / warm-up / wait / go sequence, leads held once prompts come in groups, leads following
a shared prefix's warm-up, and the compiled front's twin of each."""

from __future__ import annotations

import asyncio
import json

from hypothesis import example, given, settings
from hypothesis import strategies as st

from sessiongate import _core
from sessiongate.engines.siblings import (
    LEAD_HOLD_FROM,
    SIBLING_MIN_UNITS,
    Key,
    Siblings,
    prompt_key,
    shared_units,
    warmup_body,
)


def _body(**doc: object) -> bytes:
    return json.dumps(doc).encode()


IDS = list(range(300, 300 + SIBLING_MIN_UNITS))


def test_only_long_generate_prompts_count() -> None:
    assert prompt_key("POST", "/generate", _body(input_ids=IDS)) is not None
    assert prompt_key("POST", "/generate", _body(input_ids=IDS[:-1])) is None
    assert prompt_key("GET", "/generate", _body(input_ids=IDS)) is None
    assert prompt_key("POST", "/v1/completions", _body(input_ids=IDS)) is None
    assert prompt_key("POST", "/generate", b"{not json") is None
    assert prompt_key("POST", "/generate", b"[1, 2]") is None
    assert prompt_key("POST", "/generate", _body(input_ids=[-1] * 64)) is None
    assert prompt_key("POST", "/generate", _body(input_ids=[True] * 64)) is None
    assert prompt_key("POST", "/generate", _body(text="x" * 64)) is not None
    assert prompt_key("POST", "/generate", _body(text="x" * 63)) is None
    # Token ids that do not count do not fall back to the text.
    assert prompt_key("POST", "/generate", _body(input_ids=[1], text="x" * 64)) is None


def test_the_adapter_and_extra_key_part_prompts_and_ride_the_warm_up() -> None:
    math = prompt_key("POST", "/generate", _body(input_ids=IDS, lora_path="math", extra_key="k"))
    code = prompt_key("POST", "/generate", _body(input_ids=IDS, lora_path="code", extra_key="k"))
    assert math is not None and math != code
    same = prompt_key(
        "POST",
        "/generate",
        _body(input_ids=IDS, lora_path="math", extra_key="k", sampling_params={"n": 1}),
    )
    assert same == math, "sampling parameters are no part of the prompt"
    warm = json.loads(warmup_body(math))
    assert warm == {
        "input_ids": IDS[:-1],  # the last id is recomputed by every request: not warmed
        "sampling_params": {"max_new_tokens": 0},
        "lora_path": "math",
        "extra_key": "k",
    }


# Bodies near the rules' edges: short and long prompts, ids and text, odd values.
_ids = st.lists(st.integers(min_value=-2, max_value=(1 << 64) + 1), min_size=60, max_size=70)
_value = st.one_of(
    st.none(), st.text(max_size=5), st.integers(-3, 3), st.lists(st.integers(0, 3), max_size=2)
)
_docs = st.fixed_dictionaries(
    {},
    optional={
        "input_ids": st.one_of(_ids, st.none(), st.text(max_size=3)),
        "text": st.one_of(st.text(min_size=60, max_size=70), st.none(), st.integers()),
        "lora_path": _value,
        "extra_key": _value,
        "rid": st.text(max_size=4),
    },
)


@settings(max_examples=300, deadline=None)
@given(
    doc=_docs, method=st.sampled_from(["POST", "GET"]), path=st.sampled_from(["/generate", "/x"])
)
def test_the_compiled_front_warms_up_what_the_specification_does(
    doc: dict[str, object], method: str, path: str
) -> None:
    body = json.dumps(doc).encode()
    key = prompt_key(method, path, body)
    compiled = _core.front_sibling_warmup(method, path, body)
    if key is None:
        assert compiled is None
    else:
        assert compiled is not None
        assert json.loads(compiled) == json.loads(warmup_body(key))


def _run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


class _Gated:
    """Requests with one prompt on engine e0, logging when each may go, and a warm-up that
    answers when `gate` is set."""

    def __init__(self, siblings: Siblings, key: Key) -> None:
        self.siblings, self.key = siblings, key
        self.events: list[str] = []
        self.gate = asyncio.Event()

    async def warm_up(self, body: bytes) -> bool:
        self.events.append("warm-up")
        await self.gate.wait()
        return True

    async def request(self, name: str, key: Key | None = None) -> None:
        await self.siblings.enter("e0", key or self.key, self.warm_up)
        self.events.append(name)


def test_a_lead_goes_a_sibling_warms_up_once_and_the_rest_wait_for_it() -> None:
    async def main() -> tuple[list[str], dict[str, int]]:
        siblings = Siblings()
        siblings.grouped = 0.0  # prompts have been coming alone: leads are not held
        key = prompt_key("POST", "/generate", _body(input_ids=IDS))
        assert key is not None
        gated = _Gated(siblings, key)
        await gated.request("lead")  # nothing in flight: goes at once
        waiting = [asyncio.create_task(gated.request(f"sibling{i}")) for i in range(3)]
        await asyncio.sleep(0.01)
        gated.events.append("release")
        gated.gate.set()
        await asyncio.gather(*waiting)
        await gated.request("later")  # warmed: goes at once
        await siblings.enter("e1", key, gated.warm_up)  # another engine: its own lead
        gated.events.append("other engine")
        return gated.events, siblings.stats()

    events, stats = _run(main())  # type: ignore[misc]
    assert events == [
        "lead",
        "warm-up",
        "release",
        "sibling0",
        "sibling1",
        "sibling2",
        "later",
        "other engine",
    ]
    assert stats == {
        "siblings_held": 3,
        "leads_held": 0,
        "leads_followed": 0,
        "warmups": 1,
        "warmups_failed": 0,
    }


def test_a_failed_warm_up_releases_its_siblings_and_a_new_lead_starts_afresh() -> None:
    async def main() -> tuple[dict[str, int], int]:
        siblings = Siblings(wait_secs=5)
        siblings.grouped = 0.0
        key = prompt_key("POST", "/generate", _body(text="y" * 80))
        assert key is not None
        calls = 0

        async def broken(body: bytes) -> bool:
            nonlocal calls
            calls += 1
            raise ConnectionError("engine gone")

        await siblings.enter("e0", key, broken)
        await siblings.enter("e0", key, broken)  # released despite the failure
        siblings.leave("e0", key)
        siblings.leave("e0", key)
        await siblings.enter("e0", key, broken)  # nothing in flight: a new lead
        return siblings.stats(), calls

    stats, calls = _run(main())  # type: ignore[misc]
    assert stats == {
        "siblings_held": 1,
        "leads_held": 0,
        "leads_followed": 0,
        "warmups": 1,
        "warmups_failed": 1,
    }
    assert calls == 1


def test_a_slow_warm_up_holds_a_sibling_no_longer_than_the_bound() -> None:
    async def main() -> None:
        siblings = Siblings(wait_secs=0.05)
        siblings.grouped = 0.0
        key = prompt_key("POST", "/generate", _body(input_ids=IDS))
        assert key is not None
        never = asyncio.Event()

        async def stuck(body: bytes) -> bool:
            await never.wait()
            return True

        await siblings.enter("e0", key, stuck)
        await asyncio.wait_for(siblings.enter("e0", key, stuck), timeout=5)

    _run(main())


def test_off_reads_nothing() -> None:
    assert Siblings(enabled=False).key("POST", "/generate", _body(input_ids=IDS)) is None


def _key(prompt: int) -> Key:
    """Prompt `prompt` as the compiled twin's hook builds it: SIBLING_MIN_UNITS ids of it."""
    return ("ids", (prompt,) * SIBLING_MIN_UNITS, None, None)


def test_leads_are_held_once_prompts_come_in_groups() -> None:
    siblings = Siblings()
    # Undecided at the start: the first lead is held; prompts that come alone are not, from
    # the first that ends alone.
    assert siblings.admit("e0", _key(0)) == "warm_up"
    siblings.leave("e0", _key(0))
    for p in range(1, 4):
        assert siblings.admit("e0", _key(p)) == "go"
        siblings.leave("e0", _key(p))
    assert siblings.grouped < LEAD_HOLD_FROM
    p = 10
    while siblings.grouped < LEAD_HOLD_FROM:  # groups: each first sibling raises it
        assert siblings.admit("e0", _key(p)) == "go"
        assert siblings.admit("e0", _key(p)) == "warm_up"
        p += 1
    assert p - 10 == 3, "three groups in a row make prompts grouped again (weight 1/8)"
    assert siblings.admit("e1", _key(p)) == "warm_up", "another engine: its own held lead"
    assert siblings.admit("e0", _key(p)) == "warm_up", "the lead sends it"
    assert siblings.admit("e0", _key(p)) == "wait"
    siblings.warmed("e0", _key(p), True)
    assert siblings.admit("e0", _key(p)) == "go"
    assert siblings.stats()["leads_held"] == 3
    # A held lead without siblings counts as a prompt that came alone.
    before = siblings.grouped
    assert siblings.admit("e0", _key(99)) == "warm_up"
    siblings.warmed("e0", _key(99), True)
    siblings.leave("e0", _key(99))
    assert siblings.grouped < before


def test_a_held_lead_waits_for_its_own_warm_up() -> None:
    async def main() -> list[str]:
        siblings = Siblings()
        siblings.grouped = 1.0
        gated = _Gated(siblings, _key(5))
        lead = asyncio.create_task(gated.request("lead"))
        await asyncio.sleep(0.01)
        gated.events.append("release")
        gated.gate.set()
        await lead
        return gated.events

    assert _run(main()) == ["warm-up", "release", "lead"]


def _shared(prefix: int, tail: int, length: int = 100) -> Key:
    """A prompt of `length` ids of `prefix` then 10 ids of `tail`."""
    return ("ids", (prefix,) * length + (tail,) * 10, None, None)


def test_shared_units_count_within_one_namespace() -> None:
    assert shared_units(_shared(1, 2), _shared(1, 3)) == 100
    assert shared_units(_shared(1, 2), _shared(1, 2)) == 110
    assert shared_units(_shared(1, 2), _shared(4, 2)) == 0
    assert shared_units(_shared(1, 2), ("ids", (1,) * 30, None, None)) == 30
    assert shared_units(("text", "abcdef", None, None), ("text", "abcxyz", None, None)) == 3
    assert shared_units(("text", "abc", None, None), ("ids", (1, 2), None, None)) == 0
    assert shared_units(_shared(1, 2), ("ids", _shared(1, 2)[1], '"math"', None)) == 0


def test_a_lead_sharing_a_prefix_being_warmed_up_follows_it() -> None:
    siblings = Siblings()
    assert siblings.admit("e0", _shared(1, 1)) == "warm_up"
    assert siblings.admit("e1", _shared(1, 2)) == "warm_up", "another engine: no anchor"
    assert siblings.admit("e0", _shared(1, 2)) == "follow"
    assert siblings.admit("e0", _shared(1, 2)) == "wait", "its sibling waits with it"
    assert siblings.admit("e0", _shared(1, 3, length=60)) == "warm_up", "too short a prefix"
    siblings.warmed("e0", _shared(1, 1), True)
    assert siblings.resume("e0", _shared(1, 2)) == "warm_up", "a sibling joined: its own"
    # The prefix is held on e0 now (a warmed prompt in flight shares it): no more following.
    assert siblings.admit("e0", _shared(1, 4)) == "warm_up"
    assert siblings.admit("e1", _shared(1, 5)) == "follow"
    assert siblings.resume("e1", _shared(1, 5)) == "go", "alone: it goes"
    assert siblings.resume("e1", _shared(1, 5)) == "go", "resumed once"
    assert siblings.stats()["leads_followed"] == 2
    assert siblings.stats()["leads_held"] == 6


def test_followers_wait_for_the_shared_prefix_then_go_together() -> None:
    """The multi-turn first burst: one prompt warmed up, the others after it."""

    async def main() -> list[str]:
        siblings = Siblings()
        gated = _Gated(siblings, _shared(1, 0))
        first = asyncio.create_task(gated.request("first"))
        await asyncio.sleep(0.01)
        others = [asyncio.create_task(gated.request(f"other{t}", _shared(1, t))) for t in (1, 2, 3)]
        await asyncio.sleep(0.01)
        gated.events.append("release")
        gated.gate.set()
        await asyncio.gather(first, *others)
        return gated.events

    events = _run(main())
    assert events[:2] == ["warm-up", "release"], "one warm-up while the others wait"
    assert sorted(events[2:]) == ["first", "other1", "other2", "other3"]


def test_a_follower_whose_anchor_leaves_goes() -> None:
    async def main() -> str:
        siblings = Siblings(wait_secs=5)
        never = asyncio.Event()

        async def stuck(body: bytes) -> bool:
            await never.wait()
            return True

        anchor = asyncio.create_task(siblings.enter("e0", _shared(1, 0), stuck))
        await asyncio.sleep(0.01)
        follower = asyncio.create_task(siblings.enter("e0", _shared(1, 1), stuck))
        await asyncio.sleep(0.01)
        assert not follower.done()
        anchor.cancel()
        siblings.leave("e0", _shared(1, 0))  # its request gave up
        await asyncio.wait_for(follower, timeout=5)
        return siblings.resume("e0", _shared(1, 1))

    assert _run(main()) == "go"


# Sequences of requests entering, resuming, warm-ups answering and requests leaving, over two
# engines and prompts that share prefixes (two prefixes of 70 or 140 ids, two tails), with
# took flags.
_prompts = st.tuples(st.integers(0, 1), st.sampled_from([70, 140]), st.integers(0, 1))
_ops = st.lists(
    st.tuples(
        st.sampled_from(["enter", "enter", "enter", "resume", "warmed", "leave", "leave"]),
        st.integers(0, 1),
        _prompts,
        st.booleans(),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(ops=_ops)
# A follower that siblings joined resumes into its own warm-up.
@example(
    ops=[
        ("enter", 0, (1, 70, 0), False),
        ("enter", 0, (1, 140, 1), False),
        ("enter", 0, (1, 140, 1), False),
        ("warmed", 0, (1, 70, 0), True),
        ("resume", 0, (1, 140, 1), False),
    ]
)
def test_the_compiled_front_holds_what_the_specification_does(
    ops: list[tuple[str, int, tuple[int, int, int], bool]],
) -> None:
    siblings = Siblings()
    roles: list[str] = []
    compiled_ops = []
    for op, engine, (prefix, length, tail), flag in ops:
        url, key = f"e{engine}", _shared(prefix, tail, length)
        compiled_ops.append((op, engine, list(key[1]), flag))
        if op == "enter":
            roles.append(siblings.admit(url, key))
        elif op == "resume":
            roles.append(siblings.resume(url, key))
        elif op == "warmed":
            siblings.warmed(url, key, flag)
            roles.append("")
        else:
            siblings.leave(url, key)
            roles.append("")
    stats = siblings.stats()
    names = ("siblings_held", "leads_held", "leads_followed", "warmups", "warmups_failed")
    counts = tuple(stats[name] for name in names)
    assert _core.front_siblings_roles(compiled_ops) == (roles, siblings.grouped, counts)

"""The step scheduler and the prefix cache it fills, in process (no timing thresholds:
counters and order only).

The scheduler follows SGLang's loop (managers/scheduler.py): admit, match the prefix cache
at schedule time, prefill (the prompt enters the cache when the prefill completes), then
decode steps of the whole running batch.
"""

from __future__ import annotations

import asyncio

import pytest

from sessiongate.mock_engine.config import MockEngineConfig
from sessiongate.mock_engine.prefix_cache import PrefixCache
from sessiongate.mock_engine.scheduler import Job, StepScheduler


def _config(**kw: float | int | bool) -> MockEngineConfig:
    return MockEngineConfig(step_scheduler=True, prefill_us_per_token=0.0, decode_step_ms=0.0, **kw)  # type: ignore[arg-type]


def _job(prompt: list[int], out: int = 3, ns: str = "") -> Job:
    return Job(prompt, list(range(1000, 1000 + out)), ns, asyncio.Event())


def test_prompt_is_cached_when_its_prefill_completes() -> None:
    # mem_cache/radix_cache.py `cache_unfinished_req` after the prefill: a second request
    # admitted later matches the first one's prompt while the first still decodes.
    async def main() -> tuple[int, int]:
        cache = PrefixCache(1 << 16)
        sch = StepScheduler(_config(), cache, asyncio.Event())
        a = _job([1, 2, 3, 4, 5], out=50)
        sch.submit(a)
        await sch.wait(a, 1)  # a's prefill is done
        b = _job([1, 2, 3, 4, 5, 6])
        sch.submit(b)
        await sch.wait(b, b.total)
        assert not a.finished
        a.abort.set()
        await sch.wait(a, a.total)
        return a.cached, b.cached

    assert asyncio.run(main()) == (0, 5)


def test_requests_admitted_together_do_not_share_their_prefill() -> None:
    # Matched at schedule time: two requests admitted in one step both miss.
    async def main() -> list[int]:
        sch = StepScheduler(_config(), PrefixCache(1 << 16), asyncio.Event())
        jobs = [_job([7, 7, 7, 7]), _job([7, 7, 7, 7])]
        for j in jobs:
            sch.submit(j)
        for j in jobs:
            await sch.wait(j, j.total)
        return [j.cached for j in jobs]

    assert asyncio.run(main()) == [0, 0]


def test_a_prefill_step_admits_within_max_prefill_tokens() -> None:
    # managers/schedule_policy.py `PrefillAdder`: each admitted request's uncached tokens
    # are charged to `rem_input_tokens` (--max-prefill-tokens, 16384 by default in
    # arg_groups/fields/schedule.py) and the step admits no more once it would run out; the
    # first request of a step goes in whatever its size. The requests left for the next
    # step are matched then, so a copy of a prompt admitted earlier hits the cache.
    async def main(budget: int) -> list[int]:
        sch = StepScheduler(
            _config(max_prefill_tokens=budget), PrefixCache(1 << 16), asyncio.Event()
        )
        prompt = list(range(10, 110))  # 100 tokens
        jobs = [_job(prompt), _job(prompt), _job(list(range(500, 530)))]
        for j in jobs:
            sch.submit(j)
        for j in jobs:
            await sch.wait(j, j.total)
        return [j.cached for j in jobs]

    assert asyncio.run(main(16384)) == [0, 0, 0]  # one step: nobody sees another's prompt
    # (a hit leaves the last token to compute, as SGLang: 99 of 100)
    assert asyncio.run(main(150)) == [0, 99, 0]  # the copy waits a step and hits
    assert asyncio.run(main(50)) == [0, 99, 0]  # the first of a step goes in whatever its size
    assert MockEngineConfig().max_prefill_tokens == 16384
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        MockEngineConfig(max_prefill_tokens=0)


def test_namespaces_do_not_share_prefixes() -> None:
    async def main() -> int:
        sch = StepScheduler(_config(), PrefixCache(1 << 16), asyncio.Event())
        a = _job([3, 3, 3, 3], ns="x")
        sch.submit(a)
        await sch.wait(a, a.total)
        b = _job([3, 3, 3, 3], ns="y")
        sch.submit(b)
        await sch.wait(b, b.total)
        return b.cached

    assert asyncio.run(main()) == 0


def test_max_running_requests_makes_the_rest_wait() -> None:
    async def main() -> tuple[int, int, list[int]]:
        sch = StepScheduler(_config(max_running_requests=2), PrefixCache(0), asyncio.Event())
        jobs = [_job([i, i + 1], out=4) for i in range(0, 10, 2)]
        for j in jobs:
            sch.submit(j)
        await sch.wait(jobs[0], 1)
        running, waiting = len(sch.running), len(sch.waiting)
        finished_order: list[int] = []
        for n, j in enumerate(jobs):
            await sch.wait(j, j.total)
            finished_order.append(n)
        return running, waiting, finished_order

    running, waiting, order = asyncio.run(main())
    assert (running, waiting) == (2, 3)
    assert order == [0, 1, 2, 3, 4]


def test_more_work_takes_more_steps() -> None:
    # A decode step gives every running request one token: a request sharing the engine
    # with a long one still finishes in its own number of steps, while the engine's step
    # count grows with the longest.
    async def main() -> tuple[int, int]:
        sch = StepScheduler(_config(), PrefixCache(0), asyncio.Event())
        short = _job([1, 2], out=3)
        sch.submit(short)
        await sch.wait(short, short.total)
        alone = sch.steps
        long = _job([5, 6], out=20)
        short2 = _job([8, 9], out=3)
        sch.submit(long)
        sch.submit(short2)
        await sch.wait(long, long.total)
        return alone, sch.steps - alone

    alone, busy = asyncio.run(main())
    assert busy > alone


def test_lru_eviction_under_the_token_budget() -> None:
    cache = PrefixCache(10)
    cache.insert([1, 2, 3, 4, 5, 6])
    cache.insert([7, 8, 9, 10, 11, 12])  # over budget: the first goes
    assert cache.match([1, 2, 3, 4, 5, 6, 0]) == 0
    assert cache.match([7, 8, 9, 10, 11, 12, 0]) == 6


def test_flush_empties_the_cache() -> None:
    cache = PrefixCache(100)
    cache.insert([1, 2, 3])
    cache.flush()
    assert cache.stats() == {"sequences": 0, "tokens": 0}


@pytest.mark.parametrize("speed", [0.0, -1.0])
def test_speed_must_be_positive(speed: float) -> None:
    with pytest.raises(ValueError, match="speed"):
        MockEngineConfig(speed=speed)


def test_chat_through_the_scheduler_reports_what_the_cache_matched() -> None:
    # The chat route under --step-scheduler: non-stream and stream both finish, and
    # meta_info.cached_tokens is the prefix the scheduler matched at admission.
    from starlette.testclient import TestClient

    from sessiongate.mock_engine.app import create_app

    cfg = MockEngineConfig(
        step_scheduler=True, prefill_us_per_token=0.0, decode_step_ms=0.0, completion_tokens=6
    )
    with TestClient(create_app(cfg)) as client:
        body = {"messages": [{"role": "user", "content": "hi"}], "input_ids": [5, 6, 7, 8]}
        first = client.post("/v1/chat/completions", json={**body, "return_meta_info": True})
        again = client.post("/v1/chat/completions", json={**body, "return_meta_info": True})
        stream = client.post("/v1/chat/completions", json={**body, "stream": True})
        stats = client.get("/mock/stats").json()
    assert first.json()["choices"][0]["meta_info"]["cached_tokens"] == 0
    assert again.json()["choices"][0]["meta_info"]["cached_tokens"] == 3
    assert stream.text.endswith("data: [DONE]\n\n")
    assert stats["cached_tokens"] == 6 and stats["prefilled_tokens"] == 6
    assert stats["adapter_requests"] == {"": 3}


def test_a_prefill_only_request_finishes_with_its_prefill_and_leaves_its_prompt() -> None:
    # managers/schedule_batch.py `Req.is_prefill_only` (`max_new_tokens == 0`): the request
    # is scheduled and prefilled like any other and finishes with that prefill, its prompt
    # in the radix cache; waiting for its 0 tokens must wait for that prefill (the mock
    # answered at once, before any prefill, until the router's warm-ups relied on it).
    async def main() -> tuple[bool, int, int]:
        cache = PrefixCache(1 << 16)
        sch = StepScheduler(_config(), cache, asyncio.Event())
        warm = Job([1, 2, 3, 4, 5, 6], [], "", asyncio.Event())
        sch.submit(warm)
        await sch.wait(warm, 0)
        finished = warm.finished
        b = _job([1, 2, 3, 4, 5, 6])
        sch.submit(b)
        await sch.wait(b, b.total)
        return finished, warm.cached, b.cached

    assert asyncio.run(main()) == (True, 0, 5)

"""Siblings end to end (engines/siblings.py, rust/front/siblings.rs): a GRPO-shaped burst of
one prompt through the compiled front and the Python front (in process and in a worker), to
the real mock engine with its step scheduler, which admits and caches as SGLang does.

What is checked is what the engine saw, not timing: one prefill-only warm-up of the prompt,
and every sibling finding the prompt cached; a new prompt's first request (a fresh gateway is
undecided whether prompts come in groups, so it holds leads) preceded by its own warm-up;
a burst of new prompts sharing a system prompt paying that prefix once, its first prompt's
warm-up followed by the others; none of that with --no-hold-siblings.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from support.procs import ServerProcess, free_port

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

LAYOUTS = [("compiled", "0"), ("python", "0"), ("python", "1")]
PROMPT = list(range(300, 900))  # 600 token ids
SIBLINGS = 6


@contextlib.contextmanager
def gateway(front: str, workers: str, *extra: str) -> Iterator[tuple[str, str]]:
    engine_port = free_port()
    engine = ["mock-engine", "--port", str(engine_port), "--step-scheduler"]
    # A slow enough prefill and decode that the lead is still in flight when its
    # siblings arrive.
    engine += ["--prefill-us-per-token", "200", "--decode-step-ms", "20"]
    with ServerProcess(engine, engine_port, timeout=60) as eng:
        port = free_port()
        argv = ["serve", "--port", str(port), "--workers", workers, "--front", front]
        argv += ["--backend", eng.url, *extra]
        with ServerProcess(argv, port, timeout=60) as gw:
            yield gw.url, eng.url


def generate(url: str, max_new_tokens: int, prompt: list[int] = PROMPT) -> dict[str, Any]:
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True},
    }
    reply = httpx.post(url + "/generate", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    meta: dict[str, Any] = reply.json()["meta_info"]
    return meta


def burst(url: str, engine: str) -> tuple[dict[str, Any], list[dict[str, Any]], list[int]]:
    """A lead, then its siblings while it is in flight; the replies' meta and the
    `max_new_tokens` of every request the engine received."""
    with ThreadPoolExecutor(SIBLINGS + 1) as pool:
        lead = pool.submit(generate, url, 64)
        deadline = time.monotonic() + 30
        while not httpx.get(engine + "/mock/requests", timeout=10).json()["requests"]:
            assert time.monotonic() < deadline, "the lead never reached the engine"
            time.sleep(0.01)
        siblings = [pool.submit(generate, url, 4) for _ in range(SIBLINGS)]
        metas = [s.result() for s in siblings]
        first = lead.result()
    log = httpx.get(engine + "/mock/requests", timeout=10).json()["requests"]
    return first, metas, [r["sampling_params"]["max_new_tokens"] for r in log]


@pytest.mark.parametrize(("front", "workers"), LAYOUTS)
def test_siblings_wait_for_one_warm_up_and_find_the_prompt_cached(front: str, workers: str) -> None:
    with gateway(front, workers) as (url, engine):
        lead, siblings, sent = burst(url, engine)
    assert sent.count(0) == 1, f"one warm-up (max_new_tokens 0) expected, the engine saw {sent}"
    assert sent[0] == 0, "a fresh gateway holds the lead: it sends the warm-up itself"
    assert len(sent) == SIBLINGS + 2
    assert lead["cached_tokens"] == len(PROMPT) - 1
    assert [m["cached_tokens"] for m in siblings] == [len(PROMPT) - 1] * SIBLINGS


@pytest.mark.parametrize(("front", "workers"), LAYOUTS[:2])
def test_no_hold_siblings_sends_no_warm_up(front: str, workers: str) -> None:
    with gateway(front, workers, "--no-hold-siblings") as (url, engine):
        _, siblings, sent = burst(url, engine)
    assert 0 not in sent
    assert len(sent) == SIBLINGS + 1
    assert all(m["completion_tokens"] == 4 for m in siblings)


def lead_on_busy_engine(url: str, engine: str) -> tuple[dict[str, Any], list[list[int]]]:
    """A long request, then one with another prompt while the first runs; the second's reply
    meta and, per request the engine received, [max_new_tokens, first token id]."""
    other = list(range(1000, 1000 + len(PROMPT)))
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(generate, url, 64)
        deadline = time.monotonic() + 30
        # Until the request itself (not its warm-up) is running there.
        while not any(
            r["sampling_params"]["max_new_tokens"] == 64
            for r in httpx.get(engine + "/mock/requests", timeout=10).json()["requests"]
        ):
            assert time.monotonic() < deadline, "the first request never reached the engine"
            time.sleep(0.01)
        meta = generate(url, 4, other)
        running.result()
    log = httpx.get(engine + "/mock/requests", timeout=10).json()["requests"]
    return meta, [[r["sampling_params"]["max_new_tokens"], r["input_ids"][0]] for r in log]


@pytest.mark.parametrize(("front", "workers"), LAYOUTS)
def test_a_new_prompt_on_a_busy_engine_is_warmed_up_first(front: str, workers: str) -> None:
    with gateway(front, workers) as (url, engine):
        meta, sent = lead_on_busy_engine(url, engine)
    assert sent == [[0, 300], [64, 300], [0, 1000], [4, 1000]], f"the engine saw {sent}"
    assert meta["cached_tokens"] == len(PROMPT) - 1


@pytest.mark.parametrize(("front", "workers"), LAYOUTS[:2])
def test_no_hold_siblings_holds_no_lead(front: str, workers: str) -> None:
    with gateway(front, workers, "--no-hold-siblings") as (url, engine):
        meta, sent = lead_on_busy_engine(url, engine)
    assert sent == [[64, 300], [4, 1000]], f"the engine saw {sent}"
    assert meta["cached_tokens"] == 0


SYSTEM = list(range(3000, 3400))  # a 400-id system prompt that every agent's prompt starts with
AGENTS = 6


def agent_prompt(agent: int) -> list[int]:
    return SYSTEM + list(range(4000 + 100 * agent, 4000 + 100 * agent + 80))


def first_turns(url: str, engine: str) -> tuple[list[dict[str, Any]], int, list[int]]:
    """Every agent's first turn at once on a fresh gateway: the replies' meta, the prompt
    tokens the engine prefilled, and the `max_new_tokens` of each request it received."""
    before = httpx.get(engine + "/mock/stats", timeout=10).json()["prefilled_tokens"]
    with ThreadPoolExecutor(AGENTS) as pool:
        metas = list(pool.map(lambda a: generate(url, 4, agent_prompt(a)), range(AGENTS)))
    after = httpx.get(engine + "/mock/stats", timeout=10).json()["prefilled_tokens"]
    log = httpx.get(engine + "/mock/requests", timeout=10).json()["requests"]
    return metas, after - before, [r["sampling_params"]["max_new_tokens"] for r in log]


@pytest.mark.parametrize(("front", "workers"), LAYOUTS)
def test_new_prompts_sharing_a_system_prompt_prefill_it_once(front: str, workers: str) -> None:
    with gateway(front, workers) as (url, engine):
        metas, prefilled, sent = first_turns(url, engine)
    # One warm-up, the first agent's; the others followed it, then went (no siblings joined
    # them). Without following, each held lead sends its own warm-up, and warm-ups admitted in
    # one engine step each prefill the 400 shared ids.
    assert sent == [0] + [4] * AGENTS, f"the engine saw {sent}"
    # It prefilled the system prompt once: the first agent's 480 ids (its warm-up all but the
    # last, its request the last), then each other agent's 80.
    assert prefilled == len(SYSTEM) + 80 * AGENTS, (prefilled, sent)
    assert all(m["cached_tokens"] >= len(SYSTEM) for m in metas), metas


@pytest.mark.parametrize(("front", "workers"), LAYOUTS[:2])
def test_no_hold_siblings_follows_no_prefix(front: str, workers: str) -> None:
    with gateway(front, workers, "--no-hold-siblings") as (url, engine):
        _, _, sent = first_turns(url, engine)
    assert sent == [4] * AGENTS

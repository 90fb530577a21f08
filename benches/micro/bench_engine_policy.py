"""Engine routing: the cost of one pick, Rust core vs pure-Python twin in one run.

Run with ``pytest benches/micro/bench_engine_policy.py --benchmark-only``. Each round picks
for 200 requests (each left in flight, then finished), so divide by 200 for per pick. The
workload is a rollout's: GRPO groups of 8 identical prompts of 2,000 token ids (SGLang's
native `/generate` body) over 4 engines, or the same prompts as chat text.
"""

from __future__ import annotations

import json
import random

import pytest

from sessiongate.engines.policy import get_engine_policy

URLS = [f"http://engine{i}:30000" for i in range(4)]
POLICIES = ["round_robin", "least_in_flight", "power_of_two", "cache_aware", "cache_aware_gateway"]
_rng = random.Random(0)
_SYSTEM = [_rng.randrange(150_000) for _ in range(1_500)]
PROMPTS = [_SYSTEM + [_rng.randrange(150_000) for _ in range(500)] for _ in range(25)]
IDS_BODIES = [
    json.dumps({"input_ids": p, "sampling_params": {"max_new_tokens": 256}}).encode()
    for p in PROMPTS
    for _ in range(8)
]
WORDS = ["alpha", "beta", "gamma", "delta", "step", "tool", "result", "answer"]
CHAT_BODIES = [
    json.dumps(
        {"messages": [{"role": "user", "content": " ".join(WORDS[t % 8] for t in p)}]}
    ).encode()
    for p in PROMPTS
    for _ in range(8)
]


def _run(policy: object, bodies: list[bytes]) -> list[int]:
    picks = []
    for body in bodies:
        index = policy.pick([], body)  # type: ignore[attr-defined]
        policy.started(index)  # type: ignore[attr-defined]
        picks.append(index)
    for index in picks:
        policy.finished(index)  # type: ignore[attr-defined]
    return picks


@pytest.mark.parametrize("impl", ["rust", "python"])
@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("shape", ["input_ids", "chat"])
def test_pick(benchmark, impl: str, name: str, shape: str) -> None:
    benchmark.group = f"engine policy {name}, {shape}: 200 picks"
    bodies = IDS_BODIES if shape == "input_ids" else CHAT_BODIES
    policy = get_engine_policy(impl)(name, URLS, {"seed": 1})
    picks = benchmark(_run, policy, bodies)
    assert len(picks) == len(bodies)

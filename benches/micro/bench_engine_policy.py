"""Engine routing: the cost of one pick, Rust core vs pure-Python twin in one run.

Run with ``pytest benches/micro/bench_engine_policy.py --benchmark-only``. Each round picks
for 200 requests (each left in flight, then finished), so divide by 200 for per pick. The
workload is a rollout's: GRPO groups of 8 identical prompts of 2,000 token ids (SGLang's
native `/generate` body) over 4 engines, or the same prompts as chat text. The load-aware
policies are measured with `/v1/loads` reports for every engine ("+loads": the expected-wait
path, which reads the body for the ids' count), and power_of_two without (its old rule).
"""

from __future__ import annotations

import json
import random

import pytest

from sessiongate.engines.policy import get_engine_policy

URLS = [f"http://engine{i}:30000" for i in range(4)]
POLICIES = [
    "round_robin",
    "least_in_flight",
    "power_of_two",
    "power_of_two+loads",
    "least_load+loads",
    "prefix_hash",
    "cache_aware",
    "cache_aware_gateway",
]
# What each engine's /v1/loads said: queues of different lengths, one engine's KV nearly
# full, one without a throughput. Set again at each round's start, as a poll would: the
# credit of a round's picks would otherwise pile up over the rounds.
REPORTS = [
    (4, 2, 6000, 0.3, 1800.0),
    (6, 0, 0, 0.9, 2100.0),
    (2, 1, 900, 0.5, 0.0),
    (3, 0, 200, 0.2, 2000.0),
]
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


def _run(policy: object, bodies: list[bytes], loads: bool = False) -> list[int]:
    if loads:
        for index, report in enumerate(REPORTS):
            policy.set_loads(index, report)  # type: ignore[attr-defined]
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
    policy_name, _, loads = name.partition("+")
    policy = get_engine_policy(impl)(policy_name, URLS, {"seed": 1})
    picks = benchmark(_run, policy, bodies, bool(loads))
    assert len(picks) == len(bodies)

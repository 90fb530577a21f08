"""Engine routing: the cost of one pick, Rust core vs pure-Python twin in one run.

Run with ``pytest benches/micro/bench_engine_policy.py --benchmark-only``. Each round picks
for 200 requests (each left in flight, then finished), so divide by 200 for per pick. The
workload is a rollout's: GRPO groups of 8 identical prompts of 2,000 token ids (SGLang's
native `/generate` body) over 4 engines, or the same prompts as chat text. The load-aware
policies are measured with `/v1/loads` reports for every engine ("+loads": the expected-wait
path, which reads the body for the ids' count), and power_of_two without (its old rule).
"+sticky": with `--sticky-sessions`, each body carrying its group's rid lineage
(`g<prompt>_r<sample>`), so every pick reads the rid and the group's samples meet the pin and
its 2-in-flight cap.
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
    "round_robin+sticky",
    "least_load+loads+sticky",
    "cache_aware+sticky",
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


def _with_rids(bodies: list[bytes]) -> list[bytes]:
    return [
        json.dumps({**json.loads(body), "rid": f"g{n // 8}_r{n % 8}"}).encode()
        for n, body in enumerate(bodies)
    ]


STICKY_BODIES = {"input_ids": _with_rids(IDS_BODIES), "chat": _with_rids(CHAT_BODIES)}


def _run(policy: object, bodies: list[bytes], loads: bool = False) -> list[int]:
    if loads:
        for index, report in enumerate(REPORTS):
            policy.set_loads(index, report)  # type: ignore[attr-defined]
    picks = []
    for body in bodies:
        index, key = policy.pick_keyed([], body)  # type: ignore[attr-defined]
        policy.started(index, key)  # type: ignore[attr-defined]
        picks.append((index, key))
    for index, key in picks:
        policy.finished(index, None, key)  # type: ignore[attr-defined]
    return [index for index, _ in picks]


@pytest.mark.parametrize("impl", ["rust", "python"])
@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("shape", ["input_ids", "chat"])
def test_pick(benchmark, impl: str, name: str, shape: str) -> None:
    benchmark.group = f"engine policy {name}, {shape}: 200 picks"
    policy_name, *extras = name.split("+")
    sticky = "sticky" in extras
    if sticky:
        bodies = STICKY_BODIES[shape]
    else:
        bodies = IDS_BODIES if shape == "input_ids" else CHAT_BODIES
    options = {"seed": 1, "sticky_sessions": sticky}
    policy = get_engine_policy(impl)(policy_name, URLS, options)
    picks = benchmark(_run, policy, bodies, "loads" in extras)
    assert len(picks) == len(bodies)

"""`--policy` end to end: stateless requests reach the engine the policy chooses, through the
compiled front (Rust policy) and through the Python front (the worker's pool).

Two mock engines; a GRPO-like group (the same long prompt several times) must land on one
engine under cache_aware, the next group on the other; round_robin alternates.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from support.procs import ServerProcess, free_port, mock_engine

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

GROUP = 4


@pytest.fixture(scope="module")
def engines() -> Iterator[list[ServerProcess]]:
    with mock_engine() as first, mock_engine() as second:
        yield [first, second]


def received(engines: list[ServerProcess]) -> list[int]:
    counts = []
    for engine in engines:
        reply = httpx.get(engine.url + "/mock/requests", timeout=30).json()
        counts.append(len(reply["requests"]))
    return counts


def chat(prompt: str) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": 4}


@pytest.mark.parametrize(
    ("front", "layout"), [("compiled", "0"), ("python", "0"), ("compiled", "1"), ("python", "1")]
)
def test_cache_aware_keeps_a_group_on_one_engine(
    engines: list[ServerProcess], front: str, layout: str
) -> None:
    port = free_port()
    argv = ["serve", "--port", str(port), "--workers", layout, "--front", front]
    argv += [arg for engine in engines for arg in ("--backend", engine.url)]
    with ServerProcess([*argv, "--policy", "cache_aware"], port, timeout=60) as gw:
        per_group = []
        for group in ("first", "second"):
            before = received(engines)
            prompt = f"{group} group: " + "solve this carefully " * 40
            for _ in range(GROUP):
                reply = httpx.post(gw.url + "/v1/chat/completions", json=chat(prompt), timeout=30)
                assert reply.status_code == 200, reply.text
            after = received(engines)
            per_group.append([a - b for a, b in zip(after, before, strict=True)])
    # Each group on one engine (round robin would split each 2 + 2), the two groups apart.
    assert sorted(per_group) == [[0, GROUP], [GROUP, 0]]


def test_cache_aware_is_the_default(engines: list[ServerProcess]) -> None:
    """Without --policy a group stays on one engine; --policy round_robin splits it."""
    for policy, expected in [
        ([], [[0, GROUP], [GROUP, 0]]),
        (["--policy", "round_robin"], [[2, 2]]),
    ]:
        port = free_port()
        argv = ["serve", "--port", str(port), "--workers", "0", "--front", "compiled", *policy]
        argv += [arg for engine in engines for arg in ("--backend", engine.url)]
        with ServerProcess(argv, port, timeout=60) as gw:
            before = received(engines)
            for _ in range(GROUP):
                reply = httpx.post(gw.url + "/v1/chat/completions", json=chat("same"), timeout=30)
                assert reply.status_code == 200
            after = received(engines)
        split = [a - b for a, b in zip(after, before, strict=True)]
        assert split in expected, (policy, split)


def test_a_bad_tunable_is_refused_at_start() -> None:
    import subprocess
    import sys

    argv = ["serve", "--port", str(free_port()), "--policy", "cache_aware"]
    result = subprocess.run(
        [sys.executable, "-m", "sessiongate", *argv, "--cache-threshold", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and "cache_threshold" in result.stderr

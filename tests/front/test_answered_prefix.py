"""cache_aware learns from answers end to end (engines/policy/cache_aware.py, `prefilled`):
through the compiled front and the Python front (in process and in a worker), a prompt an
engine answered makes that engine hold its prefix, so the next prompt sharing it goes there
and finds it cached. Without the pools telling the policy of the answer, the second prompt
would tie on an unheld prefix and go to the engine with the smaller tree, the other one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.procs import ServerProcess, free_port

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

LAYOUTS = [("compiled", "0"), ("python", "0"), ("python", "1")]
SYSTEM = list(range(300, 700))  # 400 shared token ids


@contextlib.contextmanager
def gateway(front: str, workers: str) -> Iterator[str]:
    with contextlib.ExitStack() as stack:
        backends = []
        for _ in range(2):
            port = free_port()
            engine = ["mock-engine", "--port", str(port), "--step-scheduler"]
            backends += ["--backend", stack.enter_context(ServerProcess(engine, port)).url]
        port = free_port()
        argv = ["serve", "--port", str(port), "--workers", workers, "--front", front]
        # Siblings not held: a fresh gateway's first lead would be warmed up first, which is
        # not what this checks.
        argv += ["--policy", "cache_aware", "--no-hold-siblings", *backends]
        yield stack.enter_context(ServerProcess(argv, port, timeout=60)).url


def generate(url: str, ids: list[int]) -> dict[str, Any]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
    reply = httpx.post(url + "/generate", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    meta: dict[str, Any] = reply.json()["meta_info"]
    return meta


@pytest.mark.parametrize(("front", "workers"), LAYOUTS)
def test_a_prompt_sharing_an_answered_prefix_follows_it(front: str, workers: str) -> None:
    with gateway(front, workers) as url:
        first = generate(url, [*SYSTEM, *range(1000, 1100)])
        second = generate(url, [*SYSTEM, *range(2000, 2100)])
    assert first["cached_tokens"] == 0
    assert second["cached_tokens"] == len(SYSTEM), "the engine that answered the first"

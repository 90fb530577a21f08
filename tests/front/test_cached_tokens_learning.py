"""cache_aware learns from replies' cached_tokens end to end (engines/policy/cache_aware.py,
`cached`): an engine that lost a prompt the gateway believed it held (here its cache was
flushed behind the gateway's back) answers the next prompt sharing it with fewer cached
tokens than believed; the relay reads the reply's cached_tokens on its way to the client,
streamed or whole, and /metrics counts what the engine lost. Through the compiled front,
which relays stateless calls itself, and the Python front's pools, in process and in a
worker (docs/routing.md, "What a reply's cached_tokens teaches").
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator

import httpx
import pytest

from support.procs import ServerProcess, free_port

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

PROMPT = list(range(300, 900))  # 600 token ids
LAYOUTS = [("compiled", "0"), ("python", "0"), ("python", "1")]


@contextlib.contextmanager
def gateway(front: str, workers: str) -> Iterator[tuple[str, list[str]]]:
    with contextlib.ExitStack() as stack:
        engines = []
        for _ in range(2):
            port = free_port()
            argv = ["mock-engine", "--port", str(port), "--prefix-cache-tokens", "100000"]
            engines.append(stack.enter_context(ServerProcess(argv, port)).url)
        port = free_port()
        argv = ["serve", "--port", str(port), "--workers", workers, "--front", front]
        argv += ["--policy", "cache_aware", "--no-hold-siblings"]
        argv += [arg for url in engines for arg in ("--backend", url)]
        yield stack.enter_context(ServerProcess(argv, port, timeout=60)).url, engines


def generate(url: str, ids: list[int], *, stream: bool = False) -> int:
    """The reply's cached_tokens (the last chunk's, streamed)."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}, "stream": stream}
    reply = httpx.post(url + "/generate", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    if not stream:
        return int(reply.json()["meta_info"]["cached_tokens"])
    found = re.findall(r'"cached_tokens":\s*(\d+)', reply.text)
    assert found, reply.text
    return int(found[-1])


def lost(url: str, want: list[int]) -> list[int]:
    """The lost-tokens counters, once they say `want` (a worker's come with its heartbeat)."""
    pattern = r"sessiongate_engine_prefix_lost_tokens_total\{[^}]*\} (\d+)"
    deadline = time.monotonic() + 5
    while True:
        text = httpx.get(url + "/metrics", timeout=10).text
        counts = [int(n) for n in re.findall(pattern, text)]
        if counts == want or time.monotonic() > deadline:
            return counts
        time.sleep(0.1)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(("front", "workers"), LAYOUTS)
def test_a_reply_short_of_the_belief_is_counted_lost(
    front: str, workers: str, stream: bool
) -> None:
    with gateway(front, workers) as (url, engines):
        assert generate(url, PROMPT) == 0
        assert generate(url, [*PROMPT, 1, 2]) == len(PROMPT), "it follows the held prompt"
        assert lost(url, [0, 0]) == [0, 0], "cached as believed: nothing lost"
        httpx.post(engines[0] + "/flush_cache", timeout=10).raise_for_status()
        assert generate(url, [*PROMPT, 1, 2, 3], stream=stream) == 0
        assert lost(url, [len(PROMPT) + 2, 0]) == [len(PROMPT) + 2, 0]
        # Computed again: held as believed from then on.
        assert generate(url, [*PROMPT, 1, 2, 3, 4]) == len(PROMPT) + 3
        assert lost(url, [len(PROMPT) + 2, 0]) == [len(PROMPT) + 2, 0]

"""Bounded fuzzing of the wire primitives (tests/support/fuzz_cases.py): frames, envelopes and
upstream replies, Rust core against its Python twin. The long run is `benches/stress/fuzz.py`."""

from __future__ import annotations

import pytest

from support.fuzz_cases import TARGETS, run

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

CASES = {"frames": 3000, "envelope": 3000, "reply": 1500}


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_fuzz_target(target: str) -> None:
    counts = run(target, seed=20261201, cases=CASES[target])
    # Both kinds of input occur: the generator exercises acceptance and refusal.
    assert counts["ok"] > 0 and counts["err"] > 0, counts


@pytest.mark.parametrize("depth", [300, 100_000])
def test_deeply_nested_bodies_are_refused_not_crashed(depth: int) -> None:
    # The Rust scanner hands documents deeper than its limit to the twin, whose json.loads
    # hits the interpreter's recursion limit: that must be the documented error.
    from sessiongate.primitives import get_impl
    from sessiongate.primitives.errors import ReplyContractError, RequestRewriteError

    nested = b"[" * depth + b"]" * depth
    for impl in (get_impl("rust"), get_impl("python")):
        try:
            impl.extract_reply(b'{"choices":' + nested + b"}")
        except ReplyContractError:
            pass
        if depth > 1000:
            with pytest.raises(RequestRewriteError, match="nested too deeply"):
                impl.rewrite_request(b'{"a":' + nested + b"}", {"input_ids": [1]})


def test_http_fuzz_against_a_real_gateway() -> None:
    # Short read timeouts so a lying Content-Length is answered (408) within the case.
    import random

    import httpx

    from support.fuzz_cases import http_case
    from support.procs import ServerProcess, free_port

    port = free_port()
    argv = ["serve", "--port", str(port), "--workers", "1"]
    argv += ["--header-timeout", "2", "--body-timeout", "1"]
    with ServerProcess(argv, port, timeout=60) as gateway:
        counts = {"ok": 0, "err": 0}
        for index in range(150):
            _, kind = http_case(random.Random(f"http:20261201:{index}"), port, timeout=20)
            counts[kind] += 1
            if index % 25 == 0:
                assert httpx.get(gateway.url + "/health", timeout=5).status_code == 200
        assert httpx.get(gateway.url + "/health", timeout=5).status_code == 200
        assert counts["err"] > 0

"""Bounded fuzzing of the wire primitives (tests/fuzz_cases.py): frames, envelopes and
upstream replies, Rust core against its Python twin. The long run is `benches/fuzz.py`."""

from __future__ import annotations

import pytest

from fuzz_cases import TARGETS, run

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

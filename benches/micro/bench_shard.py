"""Shard benchmarks: Rust core vs pure-Python twin in one run (see docs/performance.md).

Run with ``pytest benches/ --benchmark-only``; with ``--benchmark-disable`` each benchmark
runs once as a plain test (results are still checked).
"""

from __future__ import annotations

import hashlib
import uuid

import pytest

from sessiongate.primitives import get_impl

IMPLS = ["rust", "python"]
N_SHARDS = 16
# Distinct, realistic keys: root session ids (uuid4 hex).
KEYS_1K = [uuid.uuid4().hex for _ in range(1_000)]
KEYS_10K = [uuid.uuid4().hex for _ in range(10_000)]


def _reference(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") % N_SHARDS


@pytest.mark.parametrize("impl_name", IMPLS)
def test_shard_index(benchmark, impl_name):
    """One shard_index call per key, 1,000 keys per round.

    Looping inside the measured function keeps pytest-benchmark's own per-call overhead
    (comparable to the Rust call itself) out of the comparison; divide by 1,000 for per call.
    """
    benchmark.group = "shard_index: 1,000 single calls"
    shard_index = get_impl(impl_name).shard_index

    def run() -> list[int]:
        return [shard_index(key, N_SHARDS) for key in KEYS_1K]

    result = benchmark(run)
    assert result == [_reference(k) for k in KEYS_1K]


@pytest.mark.parametrize("impl_name", IMPLS)
def test_shard_indices(benchmark, impl_name):
    """One shard_indices call over 10,000 ids."""
    benchmark.group = "shard_indices: batch of 10,000 ids"
    shard_indices = get_impl(impl_name).shard_indices
    result = benchmark(shard_indices, KEYS_10K, N_SHARDS)
    assert result[:100] == [_reference(k) for k in KEYS_10K[:100]]
    assert len(result) == len(KEYS_10K)

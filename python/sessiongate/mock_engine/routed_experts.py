"""Deterministic R3 bytes: the routed-expert ids of every token, as base64 slices.

SGLang's `return_routed_experts` puts `(rows, layers, topk)` int32 expert ids in a reply;
with 48 layers and long sequences that is tens of MiB of base64 per reply. The mock draws
them from one pre-encoded pool per shape and hands out slices of it (mostly the pool's own
bytes objects), so a big reply costs hashing the token prefix, not encoding its rows. Rows are
a pure function of the engine seed and the token prefix, so tests can replay them.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

# R3 rows come from one pool of random rows per (layers, topk, experts), built once and then
# only sliced per reply (blocks placed by a hash of the token prefix): this many bytes of
# base64 (4.5 MiB raw), rounded up to whole chunks.
R3_POOL_B64 = 6 << 20
# The pool's base64 is kept in chunks of at most this size (the HTTP layer's send slice).
R3_POOL_CHUNK_B64 = 1 << 20
# A reply's rows are blocks of this many consecutive pool rows (a multiple of 3, so blocks
# are whole base64 groups); each block's place in the pool is hashed from the token prefix.
R3_BLOCK_ROWS = 96
# Runs of R3 slices smaller than this (small row shapes) are joined up to about _COALESCE_TO.
_COALESCE_BELOW = 16 << 10
_COALESCE_TO = 256 << 10


@functools.lru_cache(maxsize=16)
def _expert_tables(experts: int, topk: int) -> tuple[tuple[bytes, bytes], ...]:
    """Per slot k: (low byte, high byte) tables from a random byte b to an expert id.

    E <= 256: id = (b % E + k) % E. E > 256: id = ((b + k) % 256) * E // 256 (256 ids spread
    over the whole range). Both keep the `topk` ids of one (row, layer) distinct.
    """
    tables: list[tuple[bytes, bytes]] = []
    for k in range(topk):
        if experts <= 256:
            ids = [(b % experts + k) % experts for b in range(256)]
        else:
            ids = [((b + k) % 256) * experts // 256 for b in range(256)]
        tables.append((bytes(i & 0xFF for i in ids), bytes(i >> 8 for i in ids)))
    return tuple(tables)


def _random_rows(seed: bytes, rows: int, layers: int, topk: int, experts: int) -> bytearray:
    """Little-endian int32 `(rows, layers, topk)` expert ids drawn from `seed`.

    Bulk bytes operations only (no per-value Python objects): one random byte per (row, layer)
    from shake_256, mapped to the `topk` ids with `bytes.translate`, widened to int32 by
    strided slice assignment into a zeroed bytearray.
    """
    base = hashlib.shake_256(seed).digest(rows * layers)
    out = bytearray(rows * layers * topk * 4)
    for k, (lo, hi) in enumerate(_expert_tables(experts, topk)):
        out[4 * k :: 4 * topk] = base.translate(lo)
        if experts > 256:
            out[4 * k + 1 :: 4 * topk] = base.translate(hi)
    return out


@dataclass(frozen=True, slots=True)
class _R3Pool:
    """Pre-encoded random rows for one (layers, topk, experts), served to every request.

    The rows are counted in groups of 3: 3 rows of int32 are a multiple of 3 bytes, so the
    base64 of whole groups is unpadded and base64 slices cut at group boundaries concatenate
    into valid base64 of the concatenated rows.
    """

    groups: int  # 3-row groups in the pool (the pool's period is 3 * groups rows)
    group_b64: int  # base64 bytes of one group (4 * row bytes)
    chunk_groups: int  # groups per chunk
    chunks: tuple[bytes, ...]  # the pool's base64, `chunk_groups` groups per chunk


def _r3_pool(layers: int, topk: int, experts: int) -> _R3Pool:
    # The sizes are read at call time (and key the cache) so tests can shrink the pool.
    return _build_r3_pool(layers, topk, experts, R3_POOL_B64, R3_POOL_CHUNK_B64)


@functools.lru_cache(maxsize=8)
def _build_r3_pool(layers: int, topk: int, experts: int, pool_b64: int, chunk_b64: int) -> _R3Pool:
    """About `pool_b64` bytes of base64 random rows in chunks of at most `chunk_b64` bytes."""
    group_b64 = 4 * layers * topk * 4
    # Chunks no bigger than a send slice: whole chunks go out as the bytes objects they are.
    chunk_groups = max(1, chunk_b64 // group_b64)
    want_groups = max(1, pool_b64 // group_b64)
    n_chunks = -(-want_groups // chunk_groups)
    seed = b"sg-mock-r3-pool|%d|%d|%d|" % (layers, topk, experts)
    chunks = tuple(
        base64.b64encode(
            _random_rows(seed + i.to_bytes(8, "little"), 3 * chunk_groups, layers, topk, experts)
        )
        for i in range(n_chunks)
    )
    return _R3Pool(n_chunks * chunk_groups, group_b64, chunk_groups, chunks)


def r3_pool_rows(layers: int, topk: int, experts: int) -> int:
    """The pool's period in rows (it repeats, wrapping around, every this many)."""
    return 3 * _r3_pool(layers, topk, experts).groups


def _pool_slices(pool: _R3Pool, start: int, groups: int) -> list[bytes | memoryview]:
    """`groups` consecutive groups of the pool's base64 from group `start`, wrapping around."""
    parts: list[bytes | memoryview] = []
    at, left = start % pool.groups, groups
    while left:
        index, within = divmod(at, pool.chunk_groups)
        take = min(pool.chunk_groups - within, left)
        chunk = pool.chunks[index]
        if take == pool.chunk_groups:
            parts.append(chunk)  # the bytes object itself: the HTTP layer sends it uncopied
        else:
            lo = within * pool.group_b64
            parts.append(memoryview(chunk)[lo : lo + take * pool.group_b64])
        left -= take
        at = (at + take) % pool.groups
    return parts


def _block_offsets(
    tokens: Sequence[int], blocks: int, shape: tuple[int, int, int], seed: int, tag: bytes
) -> list[int]:
    """Pool group offset of each R3 block: a hash chain over the tokens, O(len(tokens)).

    Block j (rows `[j * B, (j + 1) * B)`) hashes the tokens `[0, j * B]`: the chain value of
    the block before it and the tokens since. Row r of block j is the routing of token r >= jB,
    so every row depends on its own token prefix only (never on tokens after it).
    """
    if blocks <= 0:
        return []
    B = R3_BLOCK_ROWS
    ids = array("q", tokens[: (blocks - 1) * B + 1])
    if sys.byteorder == "big":
        ids.byteswap()
    data = memoryview(ids).cast("B")
    pool_groups = _r3_pool(*shape).groups
    state = hashlib.blake2b(
        b"sg-mock-r3|%s|%d|%d|%d|%d" % (tag, seed, *shape), digest_size=16
    ).digest()
    offsets: list[int] = []
    lo = 0
    for j in range(blocks):
        hi = 8 * (j * B + 1)
        h = hashlib.blake2b(state, digest_size=16)
        h.update(data[lo:hi])
        state, lo = h.digest(), hi
        offsets.append(int.from_bytes(state[:8], "little") % pool_groups)
    return offsets


def _coalesce(parts: list[bytes | memoryview]) -> list[bytes | memoryview]:
    """Runs of small slices (small row shapes) joined into bytes of up to ~256 KiB, so a big
    reply is not thousands of tiny sends; slices of 16 KiB or more stay as they are."""
    out: list[bytes | memoryview] = []
    run: list[bytes | memoryview] = []
    size = 0
    for part in parts:
        if len(part) >= _COALESCE_BELOW:
            if run:
                out.append(b"".join(run) if len(run) > 1 else run[0])
                run, size = [], 0
            out.append(part)
            continue
        run.append(part)
        size += len(part)
        if size >= _COALESCE_TO:
            out.append(b"".join(run))
            run, size = [], 0
    if run:
        out.append(b"".join(run) if len(run) > 1 else run[0])
    return out


def routed_experts_b64(
    tokens: Sequence[int],
    layers: int,
    topk: int,
    experts: int,
    start: int = 0,
    *,
    seed: int = 0,
    tag: bytes = b"r3",
) -> bytes:
    """Base64 (ASCII bytes) of little-endian int32 `(rows - start, layers, topk)` expert ids,
    `rows = len(tokens) - 1` (see `routed_experts_b64_parts`)."""
    parts = routed_experts_b64_parts(tokens, layers, topk, experts, start, seed=seed, tag=tag)
    return b"".join(parts)


def routed_experts_b64_parts(
    tokens: Sequence[int],
    layers: int,
    topk: int,
    experts: int,
    start: int = 0,
    *,
    seed: int = 0,
    tag: bytes = b"r3",
) -> list[bytes | memoryview]:
    """Rows `[start, len(tokens) - 1)` of the sequence's R3 as base64 slices (their
    concatenation), mostly zero-copy views of the shared pool.

    Row r is the routing of token r and, as in SGLang, a function of the token prefix
    `tokens[:r + 1]` only (plus the engine `seed`, `tag` and the shape): a later turn that
    extends a sequence repeats the earlier rows, which "addition R3" relies on. Rows come in
    blocks of `R3_BLOCK_ROWS` (a multiple of 3): block j is that many consecutive pool rows
    from a group offset hashed from `tokens[:j * B + 1]`, so sequences with different prefixes
    get different rows from the first block boundary at or after where they differ (row 0
    depends on token 0). A block cut short by the sequence's end is the start of the
    same block. Whole 3-row groups are the pool's own base64 (bytes chunks or memoryviews,
    sent as they are: joining 80 MiB costs a copy and a long GIL hold); only a final partial
    group (`rows % 3` rows, the only padded base64) is re-encoded. A `start` that is not a
    multiple of 3 (SGLang's routed_experts_start_len) re-encodes rows `[start, rows)` from
    the groups that cover them, so the cost follows the rows asked for.
    """
    rows = len(tokens) - 1
    if rows - start <= 0 or layers <= 0 or topk <= 0:
        return []
    if start % 3:
        aligned = start - start % 3
        parts = routed_experts_b64_parts(tokens, layers, topk, experts, aligned, seed=seed, tag=tag)
        raw = base64.b64decode(b"".join(parts))
        return [base64.b64encode(memoryview(raw)[(start - aligned) * layers * topk * 4 :])]
    B = R3_BLOCK_ROWS
    pool = _r3_pool(layers, topk, experts)
    offsets = _block_offsets(tokens, -(-rows // B), (layers, topk, experts), seed, tag)
    parts = []
    for j in range(start // B, len(offsets)):
        first = max(start, j * B) - j * B  # a multiple of 3
        groups, extra = divmod(min(rows, (j + 1) * B) - j * B - first, 3)
        at = offsets[j] + first // 3
        parts += _pool_slices(pool, at, groups)
        if extra:  # the sequence ends inside a group: its first rows, padded
            group = base64.b64decode(b"".join(_pool_slices(pool, at + groups, 1)))
            parts.append(base64.b64encode(group[: extra * layers * topk * 4]))
    return _coalesce(parts)

"""Replay rows of a session as raw little-endian int32 bytes: R3 (`routed_experts`) and the
indexer's top-k, shared by the samples op and the trajectory export.

Row `r` belongs to token `r` (a turn of T tokens has T - 1 rows: the last token routes
nothing that is trained on). Two ways a session can carry R3:

- full R3: every turn's reply holds rows [0, prompt_len + completion - 1), so the first N rows
  of the session are the first N rows of one turn that covers them;
- addition R3 (the rollout framework's `routed_experts_start_len`): turn i holds only rows
  [r3_start_row, prompt_len + completion - 1), and r3_start_row is where the turn before it
  ended, so the session's rows are the patches back to back.

Both give the same bytes for the same engine behaviour, which is what lets a trajectory file
or a samples payload be independent of the mode. Base64 is decoded straight from the record's
view into the reply (binascii reads the buffer, no copy of the text) and rows are never turned
into Python objects.
"""

from __future__ import annotations

import binascii
from collections.abc import Sequence
from dataclasses import dataclass

from sessiongate.session.state import TurnRecord

INT32 = 4


class ReplayError(ValueError):
    """Replay payloads that cannot be assembled (bad base64, sizes, gaps); the message says
    which record and why."""


@dataclass(frozen=True)
class ReplayRows:
    """`rows` rows of `width` int32 values each (layers * top-k), as little-endian bytes."""

    data: bytes | bytearray | memoryview
    rows: int
    width: int


def record_rows(record: TurnRecord) -> int:
    """Rows a turn's reply covers up to: all its tokens but the last."""
    return max(0, record.prompt_len + len(record.completion_ids) - 1)


def decoded_len(text: memoryview | bytes) -> int:
    """Bytes the base64 `text` decodes to, from its length and padding (nothing decoded)."""
    view = memoryview(text).cast("B")
    size = len(view)
    if size == 0:
        return 0
    pad = (view[-1] == ord("=")) + (size > 1 and view[-2] == ord("="))
    return size // 4 * 3 - pad


def decode_b64(text: memoryview | bytes, what: str) -> bytes:
    """Strict base64 decode of a payload (the buffer is read in place)."""
    try:
        return binascii.a2b_base64(text, strict_mode=True)
    except (binascii.Error, ValueError) as exc:
        raise ReplayError(f"{what} is not valid base64: {exc}") from exc


def row_width(size: int, rows: int, what: str) -> int:
    """int32 values per row of a `size`-byte payload that must hold whole `rows` rows."""
    if rows == 0:
        if size:
            raise ReplayError(f"{what} holds {size} bytes for 0 rows")
        return 0
    width, rest = divmod(size, INT32 * rows)
    if rest or width == 0:
        raise ReplayError(f"{what} holds {size} bytes: not a whole number of int32 rows for {rows}")
    return width


def check_full_payload(text: memoryview, rows: int, what: str) -> int:
    """Size check of a full payload of `rows` rows without decoding it; returns the width."""
    return row_width(decoded_len(text), rows, what)


def full_rows(text: memoryview, own_rows: int, rows: int, what: str) -> ReplayRows:
    """The first `rows` rows of a payload that holds `own_rows` rows from row 0."""
    if rows > own_rows:
        raise ReplayError(f"{what} covers {own_rows} rows, {rows} are needed")
    raw = decode_b64(text, what)
    width = row_width(len(raw), own_rows, what)
    return ReplayRows(memoryview(raw)[: rows * width * INT32], rows, width)


def addition_routed_rows(records: Sequence[TurnRecord], rows: int) -> ReplayRows | None:
    """The first `rows` R3 rows from addition-R3 patches, or None when no record carries R3.

    Walks the records in order until the rows are covered, as the framework's
    `merge_samples_with_addition_r3` does: every patch must start where the previous one
    ended, hold whole rows of one width, and be non-empty exactly when it covers rows.
    """
    if all(record.routed_experts is None for record in records):
        return None
    out: bytearray | None = None
    width = 0
    covered = 0
    have_patch = False
    for index, record in enumerate(records):
        if have_patch and covered >= rows:
            break
        what = f"additional R3: record {index}"
        text = record.routed_experts
        if text is None:
            raise ReplayError(f"{what} has no routed_experts payload")
        start, end = record.r3_start_row, record.prompt_len + len(record.completion_ids) - 1
        if start != covered:
            raise ReplayError(f"{what} starts at row {start}; expected {covered}")
        if end < start:
            raise ReplayError(f"{what} has invalid offsets (start={start}, end={end})")
        delta = end - start
        if bool(len(text)) != bool(delta):
            raise ReplayError(f"{what} payload presence does not match {delta} rows")
        if delta:
            patch = decode_b64(text, f"{what} routed_experts")
            patch_width = row_width(len(patch), delta, f"{what} routed_experts")
            if out is None:
                width = patch_width
                out = bytearray(rows * width * INT32)
            elif patch_width != width:
                raise ReplayError(
                    f"{what} has {patch_width} values per row; earlier patches have {width}"
                )
            take = max(0, min(delta, rows - covered))
            lo = covered * width * INT32
            out[lo : lo + take * width * INT32] = memoryview(patch)[: take * width * INT32]
        if delta or rows == 0:
            have_patch = True
        covered = end
    if covered < rows:
        raise ReplayError(
            f"additional R3 covers {covered} rows but the sample needs {rows} (len(tokens) - 1)"
        )
    return ReplayRows(out if out is not None else b"", rows, width)


def is_addition(records: Sequence[TurnRecord]) -> bool:
    """Records of an addition-R3 session: some turn asked for rows from past row 0.

    (A one-turn addition session starts at row 0 and is indistinguishable from full R3,
    which is fine: its payload is the same.)
    """
    return any(record.r3_start_row > 0 for record in records)


def session_routed_rows(records: Sequence[TurnRecord], rows: int) -> ReplayRows | None:
    """The first `rows` R3 rows of a session, in either mode; None when no turn has R3.

    Full R3: the latest turn that carries R3 and covers the rows (the last one, normally:
    each prompt holds every earlier token).
    """
    if all(record.routed_experts is None for record in records):
        return None
    if is_addition(records):
        return addition_routed_rows(records, rows)
    for index in range(len(records) - 1, -1, -1):
        record = records[index]
        if record.routed_experts is not None and record_rows(record) >= rows:
            what = f"record {index} routed_experts"
            return full_rows(record.routed_experts, record_rows(record), rows, what)
    raise ReplayError(f"no turn's routed_experts covers the session's {rows} rows")

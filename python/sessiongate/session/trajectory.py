"""The training view of a session as a safetensors file (see docs/trajectory.md).

Tensors: `token_ids` int32 [T] (the accumulated ids), `logprobs` float32 [T] (the sampled
logprob on sampled tokens, 0 elsewhere), `loss_mask` uint8 [T] (1 on sampled tokens) and,
when the session carried R3, `routed_experts` int32 [T-1, L*K] (or [T-1, L, K] when the
gateway knows top-k). Full R3: each turn's prompt contains the whole trajectory so far, so the
last turn's routed experts cover every token; addition R3: the turns' patches back to back
(`r3_rows`), so the file is the same bytes in both modes. Turn offsets, finish reasons and the
TITO metadata go into the header's `__metadata__`. A tree session's file holds these tensors
once per exported leaf, suffixed `.<i>` (docs/trajectory-trees.md).
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sessiongate.formats.safetensors import Tensor, encode
from sessiongate.session.r3_rows import ReplayError, session_routed_rows
from sessiongate.session.state import TurnRecord

FORMAT_VERSION = "1"


def build_trajectory(
    session_id: str,
    records: Sequence[TurnRecord],
    accumulated: Sequence[int],
    metadata: dict[str, Any],
    *,
    r3_topk: int = 0,
) -> list[bytes | memoryview]:
    """The safetensors file of one session, as parts to stream."""
    tensors, turns, r3_note = path_tensors(records, accumulated, r3_topk=r3_topk)
    header = {
        "format": "sessiongate.trajectory",
        "format_version": FORMAT_VERSION,
        "session_id": session_id,
        "turns": json.dumps(turns),
        "routed_experts": r3_note,
        # More than one when the session's turns span a weight update.
        "weight_versions": json.dumps(weight_versions(records)),
        **{k: json.dumps(v) for k, v in metadata.items()},
    }
    return encode(tensors, header)


def weight_versions(records: Sequence[Any]) -> list[str]:
    """The distinct `weight_version`s of `records` (turns an engine reported one for), in
    the order the session first met them."""
    seen: dict[str, None] = {}
    for record in records:
        version = getattr(record, "weight_version", None)
        if isinstance(version, str):
            seen.setdefault(version, None)
    return list(seen)


@dataclass(frozen=True)
class LeafPath:
    """One exported leaf of a tree session: its descriptor and its path's records and ids."""

    descriptor: dict[str, Any]
    records: Sequence[TurnRecord]
    accumulated: Sequence[int]


def build_tree_trajectory(
    session_id: str, leaves: Sequence[LeafPath], metadata: dict[str, Any], *, r3_topk: int = 0
) -> list[bytes | memoryview]:
    """The file of a tree session: per exported leaf i the tensors of `build_trajectory`
    named `<name>.<i>`, and `leaves` in the header (docs/trajectory-trees.md)."""
    tensors: list[Tensor] = []
    described = []
    for index, leaf in enumerate(leaves):
        own, turns, r3_note = path_tensors(
            leaf.records, leaf.accumulated, r3_topk=r3_topk, suffix=f".{index}"
        )
        tensors += own
        described.append({**leaf.descriptor, "turns": turns, "routed_experts": r3_note})
    header = {
        "format": "sessiongate.trajectory",
        "format_version": FORMAT_VERSION,
        "session_id": session_id,
        "session_mode": "tree",
        "leaves": json.dumps(described),
        **{k: json.dumps(v) for k, v in metadata.items()},
    }
    return encode(tensors, header)


def path_tensors(
    records: Sequence[TurnRecord],
    accumulated: Sequence[int],
    *,
    r3_topk: int = 0,
    suffix: str = "",
) -> tuple[list[Tensor], list[dict[str, Any]], str]:
    """The tensors of one root-to-end path, its turns table and its R3 note."""
    total = len(accumulated)
    token_ids = array("i", accumulated)
    logprobs = array("f", bytes(4 * total))
    loss_mask = bytearray(total)
    turns = []
    for index, record in enumerate(records):
        start = record.prompt_len
        end = start + len(record.completion_ids)
        turns.append(
            {
                "turn": index,
                "prompt_tokens": record.prompt_len,
                "completion_start": start,
                "completion_end": end,
                "finish_reason": record.finish_reason,
                "status": record.status,
                "weight_version": record.weight_version,
                "cached_tokens": record.cached_tokens,
                "timestamp": record.timestamp,
            }
        )
        # Earlier turns' sampled tokens stay inside later prompts at the same offsets.
        if end <= total:
            logprobs[start:end] = array("f", record.logprobs)
            loss_mask[start:end] = b"\x01" * (end - start)
    tensors = [
        Tensor(f"token_ids{suffix}", "I32", (total,), token_ids),
        Tensor(f"logprobs{suffix}", "F32", (total,), logprobs),
        Tensor(f"loss_mask{suffix}", "U8", (total,), loss_mask),
    ]
    r3_note = "absent"
    if records and total > 1:
        # A broken payload costs the file its R3 (noted in the header), not the export.
        try:
            replay = session_routed_rows(records, total - 1)
        except ReplayError as exc:
            replay, r3_note = None, f"invalid: {exc}"
        if replay is not None:
            per_token = replay.width
            shape: tuple[int, ...] = (total - 1, per_token)
            if r3_topk > 0 and per_token % r3_topk == 0:
                shape = (total - 1, per_token // r3_topk, r3_topk)
            tensors.append(Tensor(f"routed_experts{suffix}", "I32", shape, replay.data))
            r3_note = "present"
    return tensors, turns, r3_note

"""The training view of a session as a safetensors file (see docs/trajectory.md).

Tensors: `token_ids` int32 [T] (the accumulated ids), `logprobs` float32 [T] (the sampled
logprob on sampled tokens, 0 elsewhere), `loss_mask` uint8 [T] (1 on sampled tokens) and,
when the last turn carried R3, `routed_experts` int32 [T-1, L*K] (or [T-1, L, K] when the
gateway knows top-k). Each turn's prompt contains the whole trajectory so far, so the last
turn's routed experts cover every token. Turn offsets, finish reasons and the TITO metadata
go into the header's `__metadata__`.
"""

from __future__ import annotations

import base64
import binascii
import json
from array import array
from collections.abc import Sequence
from typing import Any

from sessiongate.formats.safetensors import Tensor, encode
from sessiongate.session.state import TurnRecord

FORMAT_VERSION = "1"


def _routed_experts(record: TurnRecord) -> bytes | None:
    """The raw int32 bytes of the turn's routed experts, if present and valid base64."""
    if record.routed_experts is None:
        return None
    try:
        return base64.b64decode(record.routed_experts, validate=True)
    except (binascii.Error, ValueError):
        return None


def build_trajectory(
    session_id: str,
    records: Sequence[TurnRecord],
    accumulated: Sequence[int],
    metadata: dict[str, Any],
    *,
    r3_topk: int = 0,
) -> list[bytes | memoryview]:
    """The safetensors file of one session, as parts to stream."""
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
                "timestamp": record.timestamp,
            }
        )
        # Earlier turns' sampled tokens stay inside later prompts at the same offsets.
        if end <= total:
            logprobs[start:end] = record.logprobs
            loss_mask[start:end] = b"\x01" * (end - start)
    tensors = [
        Tensor("token_ids", "I32", (total,), token_ids),
        Tensor("logprobs", "F32", (total,), logprobs),
        Tensor("loss_mask", "U8", (total,), loss_mask),
    ]
    r3_note = "absent"
    if records and total > 1:
        raw = _routed_experts(records[-1])
        if raw is not None:
            per_token, rest = divmod(len(raw), 4 * (total - 1))
            if rest == 0 and per_token > 0:
                shape: tuple[int, ...] = (total - 1, per_token)
                if r3_topk > 0 and per_token % r3_topk == 0:
                    shape = (total - 1, per_token // r3_topk, r3_topk)
                tensors.append(Tensor("routed_experts", "I32", shape, raw))
                r3_note = "present"
            else:
                r3_note = f"size mismatch: {len(raw)} bytes for {total - 1} tokens"
    header = {
        "format": "sessiongate.trajectory",
        "format_version": FORMAT_VERSION,
        "session_id": session_id,
        "turns": json.dumps(turns),
        "routed_experts": r3_note,
        **{k: json.dumps(v) for k, v in metadata.items()},
    }
    return encode(tensors, header)

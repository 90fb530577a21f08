"""A dialect turn's record (docs/api.md, "Anthropic Messages sessions"): `dialect` and the
client's body in its JSON, and both kept by the records directory's TURN entry."""

from __future__ import annotations

import json
from array import array

from sessiongate.session.state import TurnRecord
from sessiongate.session.store.turn_entry import (
    TurnEntry,
    blob_offsets,
    decode_turn,
    decode_turn_head,
    encode_turn,
)

CLIENT = b'{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"h\xc3\xa9"}]}'


def record(**extra: object) -> TurnRecord:
    return TurnRecord(
        timestamp=1.0,
        method="POST",
        path="/v1/chat/completions",
        status_code=200,
        request=b'{"input_ids":[1]}',
        response=b'{"choices":[]}',
        **extra,  # type: ignore[arg-type]
    )


def test_chat_records_keep_their_json() -> None:
    document = json.loads(record().to_json())
    assert "dialect" not in document and "client_request" not in document


def test_dialect_records_carry_the_client_body() -> None:
    document = json.loads(record(dialect="anthropic", client_request=CLIENT).to_json())
    assert document["dialect"] == "anthropic"
    assert document["client_request"] == json.loads(CLIENT)
    assert document["request"] == {"input_ids": [1]}


def test_the_turn_entry_keeps_dialect_and_client_body() -> None:
    kept = record(dialect="anthropic", client_request=CLIENT)
    entry = TurnEntry(0, 0, [], None, {}, array("q", [1]), kept, None, None)
    parts = encode_turn(entry)
    whole = b"".join(bytes(part) for part in parts)
    head, blobs_start = decode_turn_head(whole)
    request_at, _ = blob_offsets(parts)
    back = decode_turn(
        head, blobs_start, whole[blobs_start:request_at], kept.request, kept.response
    ).record
    assert back.dialect == "anthropic" and back.client_request == CLIENT
    assert back.to_json() == kept.to_json()

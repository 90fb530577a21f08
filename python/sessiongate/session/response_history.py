"""A session's OpenAI Responses history: what `previous_response_id` resolves to inside a
session (`POST /sessions/{id}/v1/responses`).

SGLang keeps, per response id, the whole input history plus the output items
(`msg_store`, serving_responses.py) and serves `previous_response_id` from it. Holding that
per turn would cost O(turns^2) memory in a long agent session, so each response keeps only
what it added (its request's own input items and its output items) and the id it continued
from; a lookup walks the chain back. Responses are remembered for the session's life (a
rollback does not forget them: a client may still continue from one) and in memory only:
after a restart an id is unknown (404), and `store: false` clients, which resend their whole
input each turn (how agent CLIs run), never need it.
"""

from __future__ import annotations

from typing import Any

from sessiongate.dialects.responses import chat_reply_to_response, own_items, session_response_id
from sessiongate.session.state import Session


def remember_response(
    session: Session, chat_reply: dict[str, Any], request: dict[str, Any]
) -> None:
    """Keep a recorded Responses turn's contribution under its response id."""
    response_id = session_response_id(chat_reply)
    response = chat_reply_to_response(chat_reply, request, response_id=response_id)
    previous = request.get("previous_response_id")
    session.responses[response_id] = (
        previous if isinstance(previous, str) else None,
        own_items(request, response),
    )


def response_items(session: Session, response_id: str) -> list[dict[str, Any]]:
    """The stored items `response_id` stands for, oldest first (KeyError: not this
    session's response)."""
    chain: list[list[dict[str, Any]]] = []
    seen: set[str] = set()
    current: str | None = response_id
    while current is not None:
        if current in seen:  # cannot happen (ids are new per turn); never loop
            break
        seen.add(current)
        previous, items = session.responses[current]
        chain.append(items)
        current = previous
    return [item for items in reversed(chain) for item in items]

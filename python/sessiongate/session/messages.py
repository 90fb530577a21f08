"""Chat message validation and history matching (append-only check, one-step rollback)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sessiongate.session.errors import BadRequest

Message = dict[str, Any]


def validate_messages(messages: object) -> list[Message]:
    """The request's `messages`, checked to be a non-empty list of objects with string roles."""
    if not isinstance(messages, list):
        raise BadRequest("field 'messages' must be a list of message objects")
    if not messages:
        raise BadRequest("field 'messages' must not be empty")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"messages[{index}] must be an object, not {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise BadRequest(f"messages[{index}].role must be a non-empty string")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise BadRequest(f"messages[{index}].content must be a string, a list or null")
    return messages


def _canonical_arguments(arguments: object) -> object:
    # Clients echo tool-call arguments back either as the JSON string we returned or as
    # an object they parsed; both denote the same call.
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _canonical_tool_calls(calls: object) -> object:
    if not calls:
        return []
    if not isinstance(calls, list):
        return calls
    canonical = []
    for call in calls:
        if isinstance(call, dict) and isinstance(call.get("function"), dict):
            function = call["function"]
            canonical.append(
                (function.get("name"), _canonical_arguments(function.get("arguments")))
            )
        else:
            canonical.append(call)
    return canonical


def _canonical_content(content: object) -> object:
    if content is None:
        return ""
    if isinstance(content, list):
        # OpenAI content parts: a list of {"type": "text", "text": ...} equals their join.
        texts = [p.get("text") for p in content if isinstance(p, dict)]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            return "".join(t for t in texts if isinstance(t, str))
    return content


def canonical_message(message: Message) -> tuple[object, ...]:
    """What makes two messages "the same turn": role, content, tool calls, tool linkage.

    Ids of tool calls and fields the template ignores (refusal, annotations) are left out,
    because agents rebuild assistant messages from our reply and rarely keep them verbatim.
    """
    return (
        message.get("role"),
        _canonical_content(message.get("content")),
        _canonical_tool_calls(message.get("tool_calls")),
        message.get("name"),
        message.get("tool_call_id") if message.get("role") == "tool" else None,
    )


def messages_match(stored: Message, requested: Message) -> bool:
    return canonical_message(stored) == canonical_message(requested)


@dataclass(frozen=True)
class HistoryPlan:
    """How a request's messages relate to the stored history.

    `base_messages` is the stored history the new turn extends (after an optional rollback),
    `checkpoint_count` how many assistant checkpoints of the session it keeps, and
    `appended` the new messages after it.
    """

    base_len: int
    checkpoint_count: int
    appended: list[Message]
    rolled_back: bool


def plan_history(
    stored: Sequence[Message],
    requested: Sequence[Message],
    *,
    session_id: str,
    allowed_roles: frozenset[str],
) -> HistoryPlan:
    """Check that `requested` extends `stored`, allowing a rollback of one assistant step.

    Raises BadRequest (and changes nothing) for any other divergence.
    """
    assistant_total = sum(1 for m in stored if m.get("role") == "assistant")
    match_len = 0
    for stored_msg, requested_msg in zip(stored, requested, strict=False):
        if not messages_match(stored_msg, requested_msg):
            break
        match_len += 1

    if match_len >= len(stored):
        base_len, checkpoints, rolled_back = len(stored), assistant_total, False
    else:
        assistants_in_match = sum(1 for m in stored[:match_len] if m.get("role") == "assistant")
        if assistants_in_match < assistant_total - 1:
            raise BadRequest(
                f"session {session_id}: messages[{match_len}] diverges from the stored history "
                f"(role {_role_at(requested, match_len)!r}, stored role "
                f"{stored[match_len].get('role')!r}); that would roll back "
                f"{assistant_total - assistants_in_match} assistant steps, only 1 is allowed"
            )
        # Roll back to just after the last assistant message that still matches.
        base_len = 0
        seen = 0
        for index, message in enumerate(stored[:match_len]):
            if message.get("role") == "assistant":
                seen += 1
                base_len = index + 1
        checkpoints, rolled_back = seen, True
        if checkpoints == 0:
            # Rolled back before the first assistant turn: the next turn is a first turn.
            base_len = 0

    appended = list(requested[base_len:])
    if checkpoints > 0:
        if not appended:
            raise BadRequest(
                f"session {session_id}: no new messages after the last assistant turn "
                f"(history has {base_len} messages)"
            )
        for offset, message in enumerate(appended):
            role = message.get("role")
            if role not in allowed_roles:
                raise BadRequest(
                    f"session {session_id}: messages[{base_len + offset}] has role {role!r}; "
                    f"roles allowed after an assistant turn: {sorted(allowed_roles)}"
                )
    return HistoryPlan(
        base_len=base_len,
        checkpoint_count=checkpoints,
        appended=appended,
        rolled_back=rolled_back,
    )


def _role_at(messages: Sequence[Message], index: int) -> object:
    return messages[index].get("role") if index < len(messages) else None

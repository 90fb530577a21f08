"""Chat message validation and history matching (append-only check, rollback to an earlier
checkpoint, up to `--max-rollback-steps` assistant steps).

History matching decides whether a replayed message is "the same turn" as the stored one. The
rollout framework (radixark/miles, ``miles/utils/chat_template_utils/message_matcher_hub``)
offers three policies, selected by name with ``--session-message-matcher``; they are rebuilt
here under the same names and rules (see docs/tokenizer.md):

- ``strict`` (the framework's default): role, content, reasoning_content and tool_calls, each
  with None / "" / [] treated as equal, tool calls compared whole except their wire-only
  ``index``.
- ``loose_tool_call``: ``strict``, or the same fields with tool-call ``arguments`` compared as
  JSON objects (a JSON string and the object it denotes are equal; types, values and array
  order still count). Call ids, types, names and reasoning_content are still compared.
- ``role_content_only``: role and content only (the stored history wins for everything else).

``canonical`` is sessiongate's own older rule (``messages_match``), kept so callers that pass
no matcher behave as before.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

from sessiongate.errors import BadRequest, MatcherError

Message = dict[str, Any]
# (stored, replayed) -> whether the replayed message continues the stored history.
MessageMatcher = Callable[[Message, Message], bool]


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
        # A tuple, not `str | list`: isinstance is faster with it, and this runs per message.
        if content is not None and not isinstance(content, (str, list)):
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
    """The ``canonical`` matcher: equal `canonical_message` projections."""
    return canonical_message(stored) == canonical_message(requested)


# --- the rollout framework's matchers ------------------------------------------------------

# What the framework's strict matcher compares: the fields chat templates read. Other keys
# (litellm's provider_specific_fields, refusal, ...) never change the rendering.
_TEMPLATE_KEYS = ("role", "content", "reasoning_content", "tool_calls")
# SGLang numbers non-streamed tool calls; clients that accumulate a stream drop or renumber it,
# and no template reads it.
_WIRE_ONLY_CALL_KEYS = frozenset({"index"})
# Fields named in a divergence error (what a reader needs to see which echo went wrong).
_REPORTED_KEYS = (*_TEMPLATE_KEYS, "name", "tool_call_id")


def _empty_as_none(value: object) -> object:
    # None, "" and [] are all falsy in jinja and render alike; clients swap them freely
    # (content null vs "" on a tool-call-only reply, tool_calls null vs []). Anything
    # non-empty, whitespace included, must match exactly: it is tokenized.
    if value is None or value == "" or value == []:
        return None
    return value


def _without_wire_keys(calls: object) -> object:
    if not isinstance(calls, list):
        return calls
    return [
        {k: v for k, v in call.items() if k not in _WIRE_ONLY_CALL_KEYS}
        if isinstance(call, dict)
        else call
        for call in calls
    ]


def _equal(left: object, right: object) -> bool:
    # A fast path's test only: a RecursionError falls back to the matcher's own comparisons.
    try:
        return left == right
    except RecursionError:
        return False


def strict_match(stored: Message, replayed: Message) -> bool:
    """The framework's ``strict`` matcher (its default).

    role, content, reasoning_content and tool_calls must be equal (Python ``==``) after
    None / "" / [] are made equal; tool calls lose only their ``index``. So a client that
    drops or edits the reasoning_content we returned, renames a call id, or sends arguments
    as an object instead of our JSON string diverges.
    """
    # Fast paths (equal values stay equal once normalised); a RecursionError in them falls
    # through to the comparisons below. Inline: this runs for every stored message.
    try:
        if stored == replayed:
            return True  # an exact echo
    except RecursionError:
        pass
    for key in _TEMPLATE_KEYS:
        left, right = stored.get(key), replayed.get(key)
        try:
            if left is right or left == right:
                continue  # echoes often add null fields (reasoning_content) we do not store
        except RecursionError:
            pass
        left, right = _empty_as_none(left), _empty_as_none(right)
        if key == "tool_calls":
            left, right = _without_wire_keys(left), _without_wire_keys(right)
        if left != right:
            return False
    return True


# Marks tool-call arguments that are not a (JSON text of a) JSON object.
_NOT_AN_OBJECT = object()


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # A duplicated key makes the text ambiguous: do not call it equal to anything parsed.
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate JSON object key {key!r}")
        result[key] = value
    return result


def _finite_decimal(text: str) -> Decimal:
    try:
        number = Decimal(text)
    except InvalidOperation as exc:
        raise ValueError(f"invalid JSON number {text!r}") from exc
    if not number.is_finite():
        raise ValueError(f"non-finite JSON number {text!r}")
    return number


def _no_constant(text: str) -> object:
    raise ValueError(f"non-standard JSON constant {text!r}")


def _tagged(value: Any, *, decimals_allowed: bool) -> tuple[Any, ...]:
    """A JSON value as a type-tagged, key-sorted tuple.

    Tags keep JSON types apart where Python equality would merge them (true vs 1, "1" vs 1);
    numbers compare exactly as decimals (1 == 1.0 == 1e0); arrays keep their order.
    """
    kind = type(value)
    if value is None:
        return ("null",)
    if kind is bool:
        return ("boolean", value)
    if kind is str:
        return ("string", value)
    if kind is int:
        return ("number", Decimal(value))
    if kind is float:
        if not math.isfinite(value):
            raise ValueError("non-finite number")
        return ("number", Decimal(str(value)))
    if kind is Decimal:
        # Decimals only come from our own parse of JSON text, never from a client's dict.
        if not decimals_allowed or not value.is_finite():
            raise ValueError("not a JSON number")
        return ("number", value)
    if kind is list:
        return (
            "array",
            tuple(_tagged(item, decimals_allowed=decimals_allowed) for item in value),
        )
    if kind is dict:
        items = value.items()
        if any(type(key) is not str for key, _ in items):
            raise ValueError("JSON object keys must be strings")
        return (
            "object",
            tuple(sorted((k, _tagged(v, decimals_allowed=decimals_allowed)) for k, v in items)),
        )
    raise ValueError(f"{kind.__name__} is not a JSON value")


def _json_object_form(arguments: Any) -> object:
    """`arguments` as a comparable JSON object, or _NOT_AN_OBJECT.

    None, "" and any spelling of {} are the empty object; a string must parse as one JSON
    object (no duplicate keys, NaN or Infinity); a dict must hold only JSON values.
    """
    if arguments is None or arguments == "":
        return ("object", ())
    from_text = type(arguments) is str
    parsed = arguments
    if from_text:
        try:
            parsed = json.loads(
                arguments,
                object_pairs_hook=_unique_keys,
                parse_int=Decimal,
                parse_float=_finite_decimal,
                parse_constant=_no_constant,
            )
        except (ValueError, TypeError, OverflowError, RecursionError):
            return _NOT_AN_OBJECT
    if type(parsed) is not dict:
        return _NOT_AN_OBJECT
    try:
        return _tagged(parsed, decimals_allowed=from_text)
    except (ValueError, TypeError, RecursionError):
        return _NOT_AN_OBJECT


def _raw_equal(left: Any, right: Any) -> bool:
    """Structural equality that also requires equal types (so 1 != 1.0 != True)."""
    try:
        if type(left) is not type(right):
            return False
        if isinstance(left, list):
            return len(left) == len(right) and all(
                _raw_equal(a, b) for a, b in zip(left, right, strict=True)
            )
        if isinstance(left, dict):
            return left.keys() == right.keys() and all(_raw_equal(left[k], right[k]) for k in left)
        return left == right
    except RecursionError:
        return False


def _arguments_match(stored: object, replayed: object) -> bool:
    left, right = _json_object_form(stored), _json_object_form(replayed)
    if left is _NOT_AN_OBJECT or right is _NOT_AN_OBJECT:
        return _raw_equal(stored, replayed)
    return left == right


def _function_matches(stored: object, replayed: object) -> bool:
    if not isinstance(stored, dict) or not isinstance(replayed, dict):
        return _raw_equal(stored, replayed)
    if stored.keys() != replayed.keys():
        return False
    return all(
        _arguments_match(stored[k], replayed[k]) if k == "arguments" else stored[k] == replayed[k]
        for k in stored
    )


def _call_matches(stored: object, replayed: object) -> bool:
    if not isinstance(stored, dict) or not isinstance(replayed, dict):
        return _raw_equal(stored, replayed)
    left = {k: v for k, v in stored.items() if k not in _WIRE_ONLY_CALL_KEYS}
    right = {k: v for k, v in replayed.items() if k not in _WIRE_ONLY_CALL_KEYS}
    if left.keys() != right.keys():
        return False
    return all(
        _function_matches(left[k], right[k]) if k == "function" else left[k] == right[k]
        for k in left
    )


def loose_tool_call_match(stored: Message, replayed: Message) -> bool:
    """The framework's ``loose_tool_call`` matcher: ``strict`` plus JSON-equal arguments.

    Everything ``strict`` accepts is accepted. Beyond that, only
    ``tool_calls[].function.arguments`` is relaxed: a JSON string and an object (or two
    spellings of the same object) are equal when they denote the same JSON object. Call
    count, order, ids, types, names, unknown keys and reasoning_content are still compared.
    """
    try:
        if strict_match(stored, replayed):
            return True
    except RecursionError:
        pass  # deeply nested arguments: fall through to the comparisons that guard depth
    for key in ("role", "content", "reasoning_content"):
        if _empty_as_none(stored.get(key)) != _empty_as_none(replayed.get(key)):
            return False
    left = _empty_as_none(stored.get("tool_calls"))
    right = _empty_as_none(replayed.get("tool_calls"))
    if not isinstance(left, list) or not isinstance(right, list):
        return _raw_equal(left, right)
    return len(left) == len(right) and all(
        _call_matches(a, b) for a, b in zip(left, right, strict=True)
    )


def role_content_only_match(stored: Message, replayed: Message) -> bool:
    """The framework's ``role_content_only`` matcher: role and content, empty values equal.

    Everything else (tool_calls, reasoning_content, names) is ignored, so the stored
    history wins for it; different tool-call lineages can collapse into one. High risk.
    """
    return all(
        _empty_as_none(stored.get(key)) == _empty_as_none(replayed.get(key))
        for key in ("role", "content")
    )


# The framework's selector names (``--session-message-matcher``), plus sessiongate's own.
MATCHERS: dict[str, MessageMatcher] = {
    "strict": strict_match,
    "loose_tool_call": loose_tool_call_match,
    "role_content_only": role_content_only_match,
    "canonical": messages_match,
}
# The framework's default selector.
DEFAULT_MATCHER = "strict"
# Built-in matchers that accept a message equal (==) to the stored one, so plan_history may
# compare whole prefixes at C speed first. Not ``canonical``: it re-parses tool-call
# arguments, and raises RecursionError on a deeply nested arguments string even when equal.
_ACCEPT_EQUAL: tuple[MessageMatcher, ...] = (
    strict_match,
    loose_tool_call_match,
    role_content_only_match,
)


def _checked(matcher: Callable[..., object], name: str) -> MessageMatcher:
    # A third-party matcher decides session identity; a broken one must fail loudly rather
    # than let a truthy non-bool or an exception be read as an answer.
    @functools.wraps(matcher)
    def checked(stored: Message, replayed: Message) -> bool:
        try:
            result = matcher(stored, replayed)
        except Exception as exc:
            raise MatcherError(f"message matcher {name} raised {type(exc).__name__}") from exc
        if type(result) is not bool:
            raise MatcherError(
                f"message matcher {name} must return bool, got {type(result).__name__}"
            )
        return result

    return checked


def resolve_matcher(name: str) -> MessageMatcher:
    """The matcher selected by `name`: a key of MATCHERS or a dotted import path.

    Raises ValueError naming the valid choices. An imported matcher is wrapped so that an
    exception or a non-bool result raises MatcherError (HTTP 500), as the framework does.
    """
    if isinstance(name, str) and name in MATCHERS:
        return MATCHERS[name]
    choices = ", ".join(MATCHERS)
    hint = f"use one of {choices}, or a dotted import path such as package.module.function"
    if not isinstance(name, str) or "." not in name.strip(".") or not all(name.split(".")):
        raise ValueError(f"unknown message matcher {name!r}; {hint}")
    module_name, _, attribute = name.rpartition(".")
    try:
        target = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"message matcher {name!r} could not be loaded ({exc}); {hint}") from exc
    if not callable(target) or _is_async(target):
        raise ValueError(f"message matcher {name!r} must be a synchronous callable; {hint}")
    return _checked(target, name)


def _is_async(target: object) -> bool:
    # The matcher runs under the session lock, synchronously: a coroutine would be truthy.
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(type(target).__call__)


# --- history planning ----------------------------------------------------------------------


@dataclass(frozen=True)
class HistoryPlan:
    """How a request's messages relate to the stored history.

    The first `base_len` stored messages are kept (after an optional rollback of
    `rollback_steps` assistant steps), `checkpoint_count` is how many checkpoints of the
    session they hold, and `appended` are
    the request's messages after them. `messages` is the history this turn renders and
    should store: the stored spelling of the kept prefix (a looser matcher may have accepted
    a reserialised echo of it) followed by `appended`.
    """

    base_len: int
    checkpoint_count: int
    appended: list[Message]
    rolled_back: bool
    messages: list[Message] = field(default_factory=list)
    rollback_steps: int = 0


def check_appended(
    appended: Sequence[Message],
    start: int,
    allowed_roles: frozenset[str],
    *,
    session_id: str,
    after: str,
) -> None:
    """The messages a turn adds after an assistant turn (at `start` in the request): at
    least one, each with an allowed role; else BadRequest naming the first culprit."""
    if not appended:
        raise BadRequest(f"session {session_id}: no new messages after {after}")
    for offset, message in enumerate(appended):
        role = message.get("role")
        if role not in allowed_roles:
            raise BadRequest(
                f"session {session_id}: messages[{start + offset}] has role {role!r}; "
                f"roles allowed after an assistant turn: {sorted(allowed_roles)}"
            )


def plan_history(
    stored: Sequence[Message],
    requested: Sequence[Message],
    *,
    session_id: str,
    allowed_roles: frozenset[str],
    matcher: MessageMatcher | str | None = None,
    checkpoint_ends: Sequence[int] | None = None,
    max_rollback: int = 1,
) -> HistoryPlan:
    """Check that `requested` extends `stored`, allowing a rollback of up to `max_rollback`
    checkpoints (`--max-rollback-steps`: an agent retrying from an older checkpoint).

    `matcher` decides when a requested message equals a stored one: a callable, a name from
    MATCHERS, or None for ``canonical`` (sessiongate's rule before matchers were selectable).
    `checkpoint_ends[i]` is the number of stored messages after generated turn i; None
    assumes every stored assistant message is a generated turn, which is wrong when a first
    turn brought assistant messages of its own (those are history, not checkpoints).

    Raises BadRequest (and changes nothing) for any other divergence.
    """
    if matcher is None:
        matcher = messages_match
    elif isinstance(matcher, str):
        matcher = resolve_matcher(matcher)
    if checkpoint_ends is None:
        ends = [i + 1 for i, m in enumerate(stored) if m.get("role") == "assistant"]
    else:
        ends = list(checkpoint_ends)
    total = len(ends)

    match_len = _matching_prefix(stored, requested, matcher)

    if match_len >= len(stored):
        base_len, checkpoints, rolled_back = len(stored), total, False
    else:
        # Roll back to the last checkpoint that lies inside the matching prefix.
        checkpoints = sum(1 for end in ends if end <= match_len)
        if checkpoints < total - max_rollback:
            allowed = "only 1 is allowed" if max_rollback == 1 else f"at most {max_rollback}"
            raise BadRequest(
                f"session {session_id}: messages[{match_len}] diverges from the stored history "
                f"(role {_role_at(requested, match_len)!r}, stored role "
                f"{stored[match_len].get('role')!r}"
                f"{_differing_fields(stored, requested, match_len)}); that would roll back "
                f"{total - checkpoints} assistant steps, {allowed} (--max-rollback-steps)"
            )
        # No checkpoint left: the next turn is a first turn, rendered from scratch.
        base_len = ends[checkpoints - 1] if checkpoints else 0
        rolled_back = True

    appended = list(requested[base_len:])
    if checkpoints > 0:
        check_appended(
            appended,
            base_len,
            allowed_roles,
            session_id=session_id,
            after=f"the last assistant turn (history has {base_len} messages)",
        )
    return HistoryPlan(
        base_len=base_len,
        checkpoint_count=checkpoints,
        appended=appended,
        rolled_back=rolled_back,
        messages=[*stored[:base_len], *appended],
        rollback_steps=total - checkpoints,
    )


def _matching_prefix(
    stored: Sequence[Message], requested: Sequence[Message], matcher: MessageMatcher
) -> int:
    """How many leading messages of `requested` the matcher accepts against `stored`."""
    if any(matcher is known for known in _ACCEPT_EQUAL):  # by identity: any callable may come
        # A verbatim echo of the history is settled by one comparison at C speed.
        common = min(len(stored), len(requested))
        if _equal(stored[:common], requested[:common]):
            return common
    match_len = 0
    for stored_msg, requested_msg in zip(stored, requested, strict=False):
        if not matcher(stored_msg, requested_msg):
            break
        match_len += 1
    return match_len


def _role_at(messages: Sequence[Message], index: int) -> object:
    return messages[index].get("role") if index < len(messages) else None


def _differing_fields(stored: Sequence[Message], requested: Sequence[Message], index: int) -> str:
    if index >= len(requested):
        return ""
    left, right = stored[index], requested[index]
    keys = [k for k in _REPORTED_KEYS if left.get(k) != right.get(k)]
    return f"; differing fields {keys}" if keys else ""

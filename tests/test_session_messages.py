"""History planning: append-only extension, one-step rollback, refusal of deeper divergence."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sessiongate.session.errors import BadRequest
from sessiongate.session.messages import messages_match, plan_history, validate_messages

ROLES = frozenset({"tool", "user"})


def conversation(turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "start"}]
    for turn in range(turns):
        messages.append({"role": "assistant", "content": f"answer {turn}"})
        messages.append({"role": "tool", "content": f"result {turn}"})
    return messages


def plan(stored: list[dict[str, Any]], requested: list[dict[str, Any]]):  # type: ignore[no-untyped-def]
    return plan_history(stored, requested, session_id="s", allowed_roles=ROLES)


def test_first_turn_takes_everything() -> None:
    p = plan([], conversation(0))
    assert (p.base_len, p.checkpoint_count, p.rolled_back) == (0, 0, False)
    assert p.appended == conversation(0)


def test_append_only_extension() -> None:
    stored = conversation(2)[:-1]  # ends with the second assistant
    requested = [*stored, {"role": "tool", "content": "new"}]
    p = plan(stored, requested)
    assert (p.base_len, p.checkpoint_count, p.rolled_back) == (len(stored), 2, False)
    assert p.appended == [{"role": "tool", "content": "new"}]


def test_one_step_rollback_to_previous_checkpoint() -> None:
    stored = conversation(3)[:-1]  # u a t a t a
    requested = [*stored[:4], {"role": "tool", "content": "retry"}]
    p = plan(stored, requested)
    assert (p.base_len, p.checkpoint_count, p.rolled_back) == (4, 2, True)
    assert p.appended == requested[4:]


def test_rollback_of_the_only_turn_restarts_the_session() -> None:
    stored = conversation(1)[:-1]  # u a
    requested = [{"role": "user", "content": "start"}]
    p = plan(stored, requested)
    assert (p.base_len, p.checkpoint_count, p.rolled_back) == (0, 0, True)


def test_deeper_divergence_is_refused() -> None:
    stored = conversation(3)[:-1]
    requested = [stored[0], stored[1], {"role": "tool", "content": "rewritten"}]
    with pytest.raises(BadRequest, match="only 1 is allowed"):
        plan(stored, requested)


def test_disallowed_role_names_its_index() -> None:
    stored = conversation(1)[:-1]
    requested = [*stored, {"role": "system", "content": "sneaky"}]
    with pytest.raises(BadRequest, match=r"messages\[2\] has role 'system'"):
        plan(stored, requested)


def test_nothing_new_after_assistant_is_refused() -> None:
    stored = conversation(1)[:-1]
    with pytest.raises(BadRequest, match="no new messages"):
        plan(stored, list(stored))


def test_matching_tolerates_echo_differences() -> None:
    ours = {
        "role": "assistant",
        "content": "x",
        "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"q": 1}'}}
        ],
    }
    echoed = {
        "role": "assistant",
        "content": [{"type": "text", "text": "x"}],
        "tool_calls": [
            {"id": "zzz", "type": "function", "function": {"name": "f", "arguments": {"q": 1}}}
        ],
        "refusal": None,
    }
    assert messages_match(ours, echoed)
    assert not messages_match(ours, {**echoed, "content": "y"})


@pytest.mark.parametrize(
    "bad", [None, "x", [], [1], [{"content": "no role"}], [{"role": "user", "content": 3}]]
)
def test_validate_messages_rejects(bad: object) -> None:
    with pytest.raises(BadRequest):
        validate_messages(bad)


@given(turns=st.integers(0, 6), cut=st.integers(0, 20), data=st.data())
def test_plan_never_keeps_more_than_stored(turns: int, cut: int, data: st.DataObject) -> None:
    stored = conversation(turns)
    if turns:
        stored = stored[:-1]
    requested = [*stored[: min(cut, len(stored))], {"role": "tool", "content": "new"}]
    try:
        p = plan(stored, requested)
    except BadRequest:
        return
    assistants = sum(1 for m in stored if m["role"] == "assistant")
    assert p.checkpoint_count in (assistants, assistants - 1) or (assistants == 0)
    assert requested[: p.base_len] == stored[: p.base_len]
    assert requested[p.base_len :] == p.appended

"""History planning: append-only extension, one-step rollback, refusal of deeper divergence."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sessiongate.errors import BadRequest, MatcherError
from sessiongate.session.messages import (
    DEFAULT_MATCHER,
    MATCHERS,
    loose_tool_call_match,
    messages_match,
    plan_history,
    resolve_matcher,
    role_content_only_match,
    strict_match,
    validate_messages,
)

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


@pytest.mark.parametrize("steps", [2, 3, 5])
def test_deeper_rollbacks_up_to_the_limit(steps: int) -> None:
    stored = conversation(5)[:-1]
    ends = [i + 1 for i, m in enumerate(stored) if m["role"] == "assistant"]
    keep = len(ends) - steps
    base = ends[keep - 1] if keep else 0
    requested = [*stored[:base], {"role": "tool" if keep else "user", "content": "retry"}]
    p = plan_history(stored, requested, session_id="s", allowed_roles=ROLES, max_rollback=steps)
    assert (p.checkpoint_count, p.rollback_steps, p.rolled_back) == (keep, steps, True)
    fewer = steps - 1
    limit = "only 1 is allowed" if fewer == 1 else f"at most {fewer}"
    with pytest.raises(BadRequest, match=f"roll back {steps} assistant steps, {limit}"):
        plan_history(stored, requested, session_id="s", allowed_roles=ROLES, max_rollback=fewer)


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


# --- selectable matchers (the rollout framework's message_matcher_hub) -----------------------


def call(arguments: Any, *, call_id: str = "call-A", **extra: Any) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "f", "arguments": arguments},
        **extra,
    }


def assistant(arguments: Any = '{"q": 1}', **fields: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": "", "tool_calls": [call(arguments)], **fields}


def test_matcher_names_and_default_follow_the_framework() -> None:
    assert list(MATCHERS)[:3] == ["strict", "loose_tool_call", "role_content_only"]
    assert DEFAULT_MATCHER == "strict"
    assert resolve_matcher("strict") is strict_match
    assert resolve_matcher("loose_tool_call") is loose_tool_call_match
    assert resolve_matcher("role_content_only") is role_content_only_match
    assert resolve_matcher("canonical") is messages_match


@pytest.mark.parametrize("name", ["", "STRICT", "loose", "nosuchmodule.matcher", "os.path.nope"])
def test_unknown_matcher_names_the_valid_ones(name: str) -> None:
    with pytest.raises(ValueError, match="strict, loose_tool_call, role_content_only, canonical"):
        resolve_matcher(name)


def test_dotted_path_matcher_is_contract_checked() -> None:
    assert resolve_matcher("operator.eq")({"role": "user"}, {"role": "user"}) is True
    with pytest.raises(MatcherError, match="must return bool, got str") as info:
        resolve_matcher("os.path.join")("a", "b")  # type: ignore[arg-type]
    assert info.value.status == 500


def test_reasoning_content_under_each_matcher() -> None:
    stored = {"role": "assistant", "content": "x", "reasoning_content": "because"}
    dropped = {"role": "assistant", "content": "x"}
    changed = {**stored, "reasoning_content": "otherwise"}
    for replayed in (dropped, changed):
        assert not strict_match(stored, replayed)
        assert not loose_tool_call_match(stored, replayed)
        assert role_content_only_match(stored, replayed)
    assert strict_match(stored, dict(stored))
    # Empty reasoning equals none at all: None, "" and [] render alike.
    assert strict_match(
        {**dropped, "reasoning_content": None}, {**dropped, "reasoning_content": ""}
    )


def test_strict_rules() -> None:
    stored = assistant(index=0)
    assert strict_match(stored, assistant(index=7))  # wire-only index is ignored
    assert strict_match(stored, {**assistant(), "refusal": None, "provider_fields": 1})
    assert strict_match({**stored, "content": None}, {**stored, "content": ""})
    assert strict_match(
        {"role": "tool", "content": "r", "tool_call_id": "a"},
        {"role": "tool", "content": "r", "tool_call_id": "b"},
    )
    assert not strict_match(stored, assistant({"q": 1}))  # object vs our JSON string
    assert not strict_match(stored, assistant('{"q":1}'))  # different spelling
    assert not strict_match(stored, {**stored, "tool_calls": [call('{"q": 1}', call_id="B")]})
    parts = {"role": "user", "content": [{"type": "text", "text": "x"}]}
    assert not strict_match({"role": "user", "content": "x"}, parts)


@pytest.mark.parametrize(
    ("stored", "replayed", "loose"),
    [
        ('{"q": 1}', {"q": 1}, True),
        ('{"b": 2, "a": [1, {"t": "\\u00e9"}]}', {"a": [1.0, {"t": "é"}], "b": 2}, True),
        (None, "{ }", True),
        ("", {}, True),
        ('{"v": 1e999}', '{"v": 10e998}', True),
        ('{"v": true}', '{"v": 1}', False),
        ('{"v": null}', '{"v": "null"}', False),
        ('{"v": [1, 2]}', '{"v": [2, 1]}', False),
        ('{"x": 1, "x": 2}', '{"x": 1,"x": 2}', False),
        ('{"x": NaN}', '{"x":NaN}', False),
        ("[]", "[ ]", False),
        ("{bad}", "{ bad }", False),
    ],
)
def test_loose_tool_call_compares_arguments_as_json_objects(
    stored: Any, replayed: Any, loose: bool
) -> None:
    assert not strict_match(assistant(stored), assistant(replayed))
    assert loose_tool_call_match(assistant(stored), assistant(replayed)) is loose
    assert role_content_only_match(assistant(stored), assistant(replayed))


def test_loose_tool_call_still_compares_call_identity() -> None:
    stored = assistant('{"q": 1}')
    for changed in (
        {**stored, "tool_calls": [call({"q": 1}, call_id="B")]},
        {**stored, "tool_calls": [{**call({"q": 1}), "type": "other"}]},
        {**stored, "tool_calls": [call({"q": 1}), call({"q": 1})]},
        {**stored, "tool_calls": [{**call({"q": 1}), "extra": 1}]},
    ):
        assert not loose_tool_call_match(stored, changed)
        assert role_content_only_match(stored, changed)
    missing = {
        **stored,
        "tool_calls": [{"id": "call-A", "type": "function", "function": {"name": "f"}}],
    }
    assert not loose_tool_call_match(missing, assistant("{}"))


def test_matchers_are_nested() -> None:
    samples = [
        {"role": "user", "content": "a"},
        {"role": "user", "content": ""},
        {"role": "user", "content": None, "name": "x"},
        assistant(index=0),
        assistant({"q": 1}, reasoning_content="r"),
        assistant('{"q": 2}'),
        {"role": "assistant", "content": "", "tool_calls": "malformed"},
    ]
    for stored in samples:
        for replayed in samples:
            strict = strict_match(stored, replayed)
            loose = loose_tool_call_match(stored, replayed)
            assert not strict or loose
            assert not loose or role_content_only_match(stored, replayed)


def reasoning_history() -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "start"},
        {"role": "assistant", "content": "a0", "reasoning_content": "think 0"},
        {"role": "tool", "content": "r0"},
        {"role": "assistant", "content": "a1", "reasoning_content": "think 1"},
    ]


def test_plan_history_takes_a_matcher_by_name_or_callable() -> None:
    stored = reasoning_history()
    # The client echoes our replies without reasoning_content.
    echoed = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in stored]
    requested = [*echoed, {"role": "tool", "content": "r1"}]
    for matcher in ("role_content_only", role_content_only_match, "canonical", None):
        p = plan_history(stored, requested, session_id="s", allowed_roles=ROLES, matcher=matcher)
        assert (p.base_len, p.checkpoint_count, p.rolled_back) == (4, 2, False)
        # The stored spelling of the kept prefix is what the turn renders and stores.
        assert p.messages == [*stored, requested[-1]]
    for matcher in ("strict", "loose_tool_call"):
        with pytest.raises(BadRequest, match=r"differing fields \['reasoning_content'\]"):
            plan_history(stored, requested, session_id="s", allowed_roles=ROLES, matcher=matcher)
    with pytest.raises(ValueError, match="unknown message matcher"):
        plan_history(stored, requested, session_id="s", allowed_roles=ROLES, matcher="nope")


def test_changed_reasoning_in_the_last_turn_rolls_back_under_strict() -> None:
    stored = reasoning_history()
    edited = {**stored[3], "reasoning_content": "edited"}
    requested = [*stored[:3], edited, {"role": "tool", "content": "x"}]
    roles = frozenset({"tool", "user", "assistant"})
    p = plan_history(stored, requested, session_id="s", allowed_roles=roles, matcher="strict")
    # The edited reply is not ours any more: back to the first checkpoint, then appended.
    assert (p.base_len, p.checkpoint_count, p.rolled_back) == (2, 1, True)
    assert p.appended == requested[2:] == p.messages[2:]
    p = plan_history(
        stored, requested, session_id="s", allowed_roles=roles, matcher="role_content_only"
    )
    assert (p.base_len, p.checkpoint_count, p.rolled_back) == (4, 2, False)
    assert p.messages[3] is stored[3]


def test_assistant_messages_of_a_first_turn_are_not_checkpoints() -> None:
    # Turn 1 brought a few-shot assistant message; only the generated reply is a checkpoint.
    stored = [
        {"role": "user", "content": "example"},
        {"role": "assistant", "content": "example answer"},
        {"role": "user", "content": "real question"},
        {"role": "assistant", "content": "generated"},
    ]
    requested = [*stored, {"role": "tool", "content": "r"}]
    p = plan_history(stored, requested, session_id="s", allowed_roles=ROLES, checkpoint_ends=[4])
    assert (p.base_len, p.checkpoint_count) == (4, 1)
    # A retry of that turn goes back to an empty session, not to the few-shot message.
    retry = [*stored[:3], {"role": "user", "content": "again"}]
    p = plan_history(stored, retry, session_id="s", allowed_roles=ROLES, checkpoint_ends=[4])
    assert (p.base_len, p.checkpoint_count, p.rolled_back) == (0, 0, True)
    assert p.messages == retry

"""Session family registry: finality flags, late registration, exactly-once session end."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from sessiongate.session_routing import RoutingContext, SessionFamilyRegistry, UnknownSessionError


def turn(reg: SessionFamilyRegistry, sid: str, final: bool = False) -> RoutingContext:
    """One whole, successful turn; returns its context."""
    ctx = reg.context_for(sid, final)
    reg.finish_turn(sid, final)
    return ctx


# -- unit tests ----------------------------------------------------------------------------


def test_lone_root_final_turn_is_family_final():
    reg = SessionFamilyRegistry()
    reg.register("r")
    ctx = reg.context_for("r", False)
    assert ctx == RoutingContext("r", None, "r", False, None, False)
    assert reg.finish_turn("r", False) is False
    ctx = reg.context_for("r", True)
    assert ctx == RoutingContext("r", None, "r", True, None, True)
    assert reg.finish_turn("r", True) is True  # on_session_end fires on the final path
    assert reg.end_session("r") is False  # ... and not again on DELETE
    assert "r" not in reg and len(reg) == 0 and reg.stats().families == 0


def test_children_keep_the_family_open_and_see_parent_finality():
    reg = SessionFamilyRegistry()
    reg.register("r")
    reg.register("c", "r")
    reg.register("g", "c")
    assert reg.root_of("g") == "r"
    assert turn(reg, "c").is_parent_final is False
    # The root finishing first does not make the family final: c and g may still talk.
    assert turn(reg, "r", final=True).is_family_final is False
    ctx = turn(reg, "c", final=True)
    assert (ctx.is_parent_final, ctx.is_family_final) == (True, False)
    ctx = turn(reg, "g", final=True)
    assert ctx == RoutingContext("g", "c", "r", True, True, True)


def test_root_final_after_children_is_family_final():
    reg = SessionFamilyRegistry()
    reg.register("r")
    reg.declare_branch("r", 2)
    assert turn(reg, "r").is_family_final is False
    reg.register("a", "r")
    reg.register("b", "r")
    turn(reg, "a", final=True)
    assert reg.end_session("b") is True  # lost/deleted before a final turn
    assert turn(reg, "r", final=True).is_family_final is True


def test_spawning_final_turn_is_never_family_final():
    reg = SessionFamilyRegistry()
    reg.register("r")
    reg.declare_branch("r")  # open-ended: "this turn spawns children"
    assert reg.context_for("r", True).is_family_final is False
    assert reg.finish_turn("r", True) is True
    reg.register("c", "r")  # registered after the parent's final turn
    # The declaration lasts until r starts another turn or ends: c's final is not provable.
    assert turn(reg, "c", final=True).is_family_final is False
    reg.end_session("r")
    reg2 = SessionFamilyRegistry()
    reg2.register("r")
    reg2.declare_branch("r", 1)
    assert turn(reg2, "r", final=True).is_family_final is False
    reg2.register("c", "r")  # pays the declaration off
    assert turn(reg2, "c", final=True).is_family_final is True


def test_counted_declaration_outlives_the_turn_until_paid():
    reg = SessionFamilyRegistry()
    reg.register("r")
    reg.declare_branch("r", 2)
    turn(reg, "r")
    reg.register("a", "r")
    turn(reg, "a", final=True)
    assert turn(reg, "r", final=True).is_family_final is False  # one child still owed
    reg.register("b", "r")
    assert turn(reg, "b", final=True).is_family_final is True


def test_open_declaration_expires_at_the_next_turn():
    reg = SessionFamilyRegistry()
    reg.register("r")
    reg.declare_branch("r")
    turn(reg, "r")
    reg.register("a", "r")
    turn(reg, "a", final=True)
    assert turn(reg, "r", final=True).is_family_final is True


def test_declaring_mid_turn_applies_to_that_turn():
    reg = SessionFamilyRegistry()
    reg.register("r")
    reg.context_for("r", False)
    reg.declare_branch("r")  # in flight: belongs to the current turn
    reg.finish_turn("r", False)
    reg.register("a", "r")
    turn(reg, "a", final=True)
    assert turn(reg, "r", final=True).is_family_final is True


def test_declare_branch_validation():
    reg = SessionFamilyRegistry()
    reg.register("r")
    for bad in (-1, True):
        with pytest.raises(ValueError, match="non-negative"):
            reg.declare_branch("r", bad)
    reg.declare_branch("r", 0)  # no-op
    assert turn(reg, "r", final=True).is_family_final is True
    with pytest.raises(UnknownSessionError, match="not registered"):
        reg.declare_branch("nope")


def test_late_child_after_everything_final_reopens_the_family():
    reg = SessionFamilyRegistry()
    reg.register("r")
    assert turn(reg, "r", final=True).is_family_final is True
    assert reg.stats().reopened == 0
    reg.register("late", "r")  # undeclared: the client broke its promise; we recover
    assert reg.stats().reopened == 1
    ctx = turn(reg, "late")
    assert (ctx.is_parent_final, ctx.is_family_final) == (True, False)
    assert turn(reg, "late", final=True).is_family_final is True


def test_turn_after_final_reopens_the_session_but_does_not_refire_end():
    reg = SessionFamilyRegistry()
    reg.register("r")
    reg.register("c", "r")
    assert turn(reg, "c", final=True).is_family_final is False
    assert reg.finish_turn("c", True) is False  # already signalled
    assert reg.context_for("c", False).is_family_final is False  # c talks again
    assert reg.finish_turn("c", False) is False
    assert turn(reg, "r", final=True).is_family_final is False  # c is open again
    assert reg.end_session("c") is False
    assert reg.context_for("r", True).is_family_final is True


def test_failed_final_turn_leaves_the_session_open():
    reg = SessionFamilyRegistry()
    reg.register("r")
    reg.register("c", "r")
    reg.context_for("c", True)
    assert reg.finish_turn("c", False) is False  # upstream failed; client may retry
    assert turn(reg, "r", final=True).is_family_final is False
    assert turn(reg, "c", final=True).is_family_final is True


def test_orphans_are_never_family_final():
    reg = SessionFamilyRegistry()
    reg.register("o", "gone", root_session_id="root")
    ctx = turn(reg, "o", final=True)
    assert ctx == RoutingContext("o", "gone", "root", True, None, False)
    reg.register("root")  # the root shows up later; the orphan still blocks proof
    assert turn(reg, "root", final=True).is_family_final is False
    reg.end_session("o")
    assert reg.context_for("root", True).is_family_final is True
    # Default root of an orphan is its parent id.
    reg.register("o2", "p2")
    assert reg.root_of("o2") == "p2"


def test_child_of_an_ended_parent_sees_parent_final():
    reg = SessionFamilyRegistry()
    reg.register("r")
    reg.register("c", "r")
    assert reg.end_session("r") is True
    ctx = turn(reg, "c", final=True)
    assert (ctx.is_parent_final, ctx.is_family_final, ctx.root_session_id) == (True, True, "r")
    reg.register("c2", "r")  # r is gone: an orphan of the same family
    assert reg.context_for("c2", False).is_parent_final is None


def test_registration_errors_and_unknown_sessions():
    reg = SessionFamilyRegistry()
    reg.register("r")
    with pytest.raises(ValueError, match="already registered"):
        reg.register("r")
    with pytest.raises(ValueError, match="cannot have root_session_id"):
        reg.register("x", root_session_id="y")
    with pytest.raises(ValueError, match="belongs to family 'r'"):
        reg.register("c", "r", root_session_id="other")
    reg.register("c", "r", root_session_id="r")
    with pytest.raises(UnknownSessionError):
        reg.context_for("missing", False)
    with pytest.raises(KeyError):  # UnknownSessionError is a KeyError
        reg.root_of("missing")
    assert reg.finish_turn("missing", True) is False
    assert reg.end_session("missing") is False


def test_release_all_returns_only_unsignalled_sessions():
    reg = SessionFamilyRegistry()
    for sid, parent in [("r", None), ("a", "r"), ("b", "r"), ("c", "a")]:
        reg.register(sid, parent)
    turn(reg, "a", final=True)  # signalled on the final path
    reg.end_session("b")  # signalled on DELETE
    assert reg.release_all() == ["r", "c"]
    assert reg.release_all() == []
    assert len(reg) == 0 and reg.stats().families == 0
    assert reg.end_session("r") is False


def test_id_reuse_after_end_is_a_new_session():
    reg = SessionFamilyRegistry()
    reg.register("s")
    assert reg.end_session("s") is True
    reg.register("s")
    assert reg.end_session("s") is True


# -- reference model -----------------------------------------------------------------------


@dataclass(eq=False)
class RefSession:
    sid: str
    parent: RefSession | None
    parent_id: str | None
    root: str
    orphan: bool
    open: bool = True
    notified: bool = False
    turns: int = 0
    in_flight: bool = False
    expected: int = 0
    open_turn: int | None = None

    def declaring(self) -> bool:
        return self.expected > 0 or self.open_turn is not None


class Reference:
    """The finality rules written the obvious way: scan the family on every question."""

    def __init__(self) -> None:
        self.live: dict[str, RefSession] = {}
        self.rooted: set[str] = set()

    def register(self, sid: str, parent_id: str | None, root: str | None) -> None:
        parent = self.live.get(parent_id) if parent_id is not None else None
        if parent_id is None:
            root = sid
            self.rooted.add(sid)
        elif parent is not None:
            root = parent.root
        else:
            root = root or parent_id
        self.live[sid] = RefSession(
            sid, parent, parent_id, root, parent_id is not None and parent is None
        )
        if parent is not None and parent.expected > 0:
            parent.expected -= 1

    def declare(self, sid: str, count: int | None) -> None:
        s = self.live[sid]
        if count is None:
            s.open_turn = s.turns if s.in_flight else s.turns + 1
        else:
            s.expected += count

    def context(self, sid: str, final: bool) -> RoutingContext:
        s = self.live[sid]
        s.turns += 1
        s.in_flight = True
        if s.open_turn is not None and s.open_turn < s.turns:
            s.open_turn = None
        s.open = True
        members = [m for m in self.live.values() if m.root == s.root]
        tree_final = (
            final
            and s.root in self.rooted
            and all(not m.open for m in members if m is not s)
            and not any(m.declaring() or m.orphan for m in members)
        )
        parent_final = None if s.parent is None else not s.parent.open
        return RoutingContext(sid, s.parent_id, s.root, final, parent_final, tree_final)

    def _claim(self, s: RefSession) -> bool:
        fire = not s.notified
        s.notified = True
        return fire

    def finish(self, sid: str, final: bool) -> bool:
        s = self.live.get(sid)
        if s is None:
            return False
        s.in_flight = False
        if not final:
            return False
        s.open = False
        return self._claim(s)

    def end(self, sid: str) -> bool:
        s = self.live.pop(sid, None)
        if s is None:
            return False
        s.open = False
        s.expected = 0
        s.open_turn = None
        if not any(m.root == s.root for m in self.live.values()):
            self.rooted.discard(s.root)
        return self._claim(s)

    def release_all(self) -> list[str]:
        out = [sid for sid, s in self.live.items() if not s.notified]
        self.live.clear()
        self.rooted.clear()
        return out


class AgreesWithReference(RuleBasedStateMachine):
    """Any op order, honest or not: the O(1) registry equals the scanning reference."""

    def __init__(self) -> None:
        super().__init__()
        self.reg = SessionFamilyRegistry()
        self.ref = Reference()
        self.counter = 0
        self.fired: dict[str, int] = {}

    def _new_id(self) -> str:
        self.counter += 1
        return f"s{self.counter}"

    def _fire(self, sid: str, fire: bool) -> None:
        if fire:
            self.fired[sid] = self.fired.get(sid, 0) + 1

    @rule()
    def new_root(self) -> None:
        sid = self._new_id()
        self.reg.register(sid)
        self.ref.register(sid, None, None)

    @precondition(lambda self: self.ref.live)
    @rule(data=st.data())
    def spawn(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(sorted(self.ref.live)))
        sid = self._new_id()
        self.reg.register(sid, parent)
        self.ref.register(sid, parent, None)

    @rule(data=st.data())
    def spawn_orphan(self, data: st.DataObject) -> None:
        # The parent is unknown here (ended or never seen); the root may or may not exist.
        roots = [*sorted({s.root for s in self.ref.live.values()}), "ghost"]
        root = data.draw(st.sampled_from(roots))
        sid = self._new_id()
        self.reg.register(sid, "unknown-parent", root_session_id=root)
        self.ref.register(sid, "unknown-parent", root)

    @precondition(lambda self: self.ref.live)
    @rule(data=st.data(), count=st.sampled_from([None, 0, 1, 2]))
    def declare(self, data: st.DataObject, count: int | None) -> None:
        sid = data.draw(st.sampled_from(sorted(self.ref.live)))
        self.reg.declare_branch(sid, count)
        if count != 0:
            self.ref.declare(sid, count)

    @precondition(lambda self: self.ref.live)
    @rule(data=st.data(), final=st.booleans())
    def begin_turn(self, data: st.DataObject, final: bool) -> None:
        sid = data.draw(st.sampled_from(sorted(self.ref.live)))
        assert self.reg.context_for(sid, final) == self.ref.context(sid, final)

    @precondition(lambda self: self.ref.live)
    @rule(data=st.data(), final=st.booleans())
    def finish_turn(self, data: st.DataObject, final: bool) -> None:
        sid = data.draw(st.sampled_from(sorted(self.ref.live)))
        fire = self.reg.finish_turn(sid, final)
        assert fire == self.ref.finish(sid, final)
        self._fire(sid, fire)

    @precondition(lambda self: self.ref.live)
    @rule(data=st.data())
    def end(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.ref.live)))
        fire = self.reg.end_session(sid)
        assert fire == self.ref.end(sid)
        self._fire(sid, fire)

    @invariant()
    def same_population(self) -> None:
        stats = self.reg.stats()
        assert stats.sessions == len(self.ref.live)
        assert stats.families == len({s.root for s in self.ref.live.values()})

    def teardown(self) -> None:
        released = self.reg.release_all()
        assert released == self.ref.release_all()
        for sid in released:
            self._fire(sid, True)
        # Exactly once per session, whatever mix of final / end / shutdown got it there.
        assert self.fired == {f"s{i}": 1 for i in range(1, self.counter + 1)}


def test_registry_agrees_with_reference_model():
    run_state_machine_as_test(
        AgreesWithReference,
        settings=settings(max_examples=300, stateful_step_count=40, deadline=None),
    )


@dataclass
class Honest:
    root: str
    in_flight: bool = False
    turn_final: bool = False
    final_done: bool = False
    credits: int = 0
    open_window: bool = False


class HonestClients(RuleBasedStateMachine):
    """Clients that keep their promises (declare before spawning, no turn after a final one).

    Safety: once any request of a family was stamped `is_family_final`, no session of that family
    ever sends another request or spawns a child. Precision: the flag is True exactly when
    the clients' own bookkeeping says nothing else can follow.
    """

    def __init__(self) -> None:
        super().__init__()
        self.reg = SessionFamilyRegistry()
        self.live: dict[str, Honest] = {}
        self.closed: set[str] = set()
        self.counter = 0

    def _new_id(self) -> str:
        self.counter += 1
        return f"h{self.counter}"

    def _request_from(self, root: str) -> None:
        assert root not in self.closed, f"family {root} was stamped final but sent again"

    def _can_turn(self) -> list[str]:
        return sorted(s for s, h in self.live.items() if not h.in_flight and not h.final_done)

    def _can_spawn(self) -> list[str]:
        return sorted(s for s, h in self.live.items() if h.credits > 0 or h.open_window)

    @rule()
    def new_root(self) -> None:
        sid = self._new_id()
        self.reg.register(sid)
        self.live[sid] = Honest(root=sid)

    @precondition(lambda self: self._can_turn())
    @rule(
        data=st.data(),
        final=st.booleans(),
        branch=st.sampled_from([None, None, None, "open", 1, 2]),
    )
    def begin_turn(self, data: st.DataObject, final: bool, branch: str | int | None) -> None:
        sid = data.draw(st.sampled_from(self._can_turn()))
        h = self.live[sid]
        self._request_from(h.root)
        h.open_window = False  # the previous turn's open declaration is over
        if branch == "open":
            self.reg.declare_branch(sid)
            h.open_window = True
        elif isinstance(branch, int):
            self.reg.declare_branch(sid, branch)
            h.credits += branch
        members = [m for m in self.live.values() if m.root == h.root]
        expected = (
            final
            and all(m.final_done for m in members if m is not h)
            and not any(m.credits or m.open_window for m in members)
        )
        ctx = self.reg.context_for(sid, final)
        assert ctx.is_family_final == expected
        h.in_flight, h.turn_final = True, final
        if ctx.is_family_final:
            self.closed.add(h.root)

    @precondition(lambda self: any(h.in_flight for h in self.live.values()))
    @rule(data=st.data())
    def finish_turn(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(s for s, h in self.live.items() if h.in_flight)))
        h = self.live[sid]
        self.reg.finish_turn(sid, h.turn_final)
        h.in_flight = False
        h.final_done = h.turn_final

    @precondition(lambda self: self._can_spawn())
    @rule(data=st.data())
    def spawn(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self._can_spawn()))
        p = self.live[parent]
        self._request_from(p.root)
        if p.credits:
            p.credits -= 1
        sid = self._new_id()
        self.reg.register(sid, parent)
        self.live[sid] = Honest(root=p.root)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def end(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.live)))
        self.reg.end_session(sid)
        del self.live[sid]


def test_family_final_is_never_followed_by_another_request():
    run_state_machine_as_test(
        HonestClients,
        settings=settings(max_examples=300, stateful_step_count=50, deadline=None),
    )

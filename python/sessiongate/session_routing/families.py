"""Session family registry: who belongs to which family, and what can be proven final.

One registry per worker (a whole family lives on one worker because children shard on their
root id). Everything is plain data mutated synchronously, so it is safe from asyncio code as
long as callers do not await between reading a context and using it; every call is O(1)
(family-wide facts are kept as counters, never recomputed by walking the family).

Finality is conservative by construction: `is_family_final` is True only when the registry can
prove that, after the current request, no session of the family may send another one. See
docs/routing.md ("Finality") for the rules and the client protocol they rely on.
"""

from __future__ import annotations

from dataclasses import dataclass

from sessiongate.session_routing.base import RoutingContext


class UnknownSessionError(KeyError):
    """The session was never registered here, or it has already ended."""

    def __str__(self) -> str:
        return f"session {self.args[0]!r} is not registered (never created, or already ended)"


@dataclass(slots=True, eq=False)
class _Family:
    root_id: str
    has_root: bool = False  # the root registered here (a family of orphans proves nothing)
    size: int = 0  # registered sessions that have not ended
    open_count: int = 0  # sessions that may still send a turn (not final, not ended)
    declaring: int = 0  # sessions with an outstanding branch declaration
    orphans: int = 0  # live sessions whose parent was unknown when they registered


@dataclass(slots=True, eq=False)
class _Node:
    session_id: str
    parent_id: str | None
    parent: _Node | None  # None for roots and orphans; may point at an ended node
    family: _Family
    orphan: bool = False
    open: bool = True  # not final and not ended
    ended: bool = False
    notified: bool = False  # on_session_end has been signalled
    turns: int = 0  # turns begun (context_for calls)
    in_flight: bool = False
    expected_children: int = 0  # still owed by counted declarations
    open_decl_turn: int | None = None  # turn an open-ended declaration belongs to

    @property
    def declaring(self) -> bool:
        return self.expected_children > 0 or self.open_decl_turn is not None


@dataclass(frozen=True, slots=True)
class FamilyStats:
    sessions: int
    families: int
    reopened: int  # times a family with nothing outstanding became active again


class SessionFamilyRegistry:
    """Roots, parent/child links, outstanding descendants and branch declarations.

    Call order per session: `register` once; per turn `declare_branch` (optional, before the
    turn's context), `context_for`, then `finish_turn`; `end_session` on DELETE / loss /
    expiry; `release_all` at shutdown. `finish_turn(final=True)`, `end_session` and
    `release_all` report when the mode's `on_session_end` must fire: exactly once per
    registered session, whichever terminal path comes first.
    """

    def __init__(self) -> None:
        self._nodes: dict[str, _Node] = {}
        self._families: dict[str, _Family] = {}
        self._reopened = 0

    # -- membership ---------------------------------------------------------------------

    def register(
        self,
        session_id: str,
        parent_session_id: str | None = None,
        *,
        root_session_id: str | None = None,
    ) -> None:
        """Add a session; children join their parent's family at any time (even late).

        A child whose parent is unknown here (ended, lost, never seen) is an orphan: it joins
        the family of `root_session_id` (default: the parent id) but that family can no longer be
        proven final while the orphan lives, and its `is_parent_final` is None.
        """
        if session_id in self._nodes:
            raise ValueError(f"session {session_id!r} is already registered")
        parent: _Node | None = None
        if parent_session_id is None:
            if root_session_id is not None and root_session_id != session_id:
                raise ValueError(
                    f"root session {session_id!r} cannot have root_session_id {root_session_id!r}"
                )
            family = self._family(session_id)
            family.has_root = True
        else:
            parent = self._nodes.get(parent_session_id)
            if parent is not None:
                family = parent.family
                if root_session_id is not None and root_session_id != family.root_id:
                    raise ValueError(
                        f"parent {parent_session_id!r} belongs to family {family.root_id!r}, "
                        f"not {root_session_id!r}"
                    )
            else:
                family = self._family(root_session_id or parent_session_id)
        self._note_reopen(family)
        orphan = parent_session_id is not None and parent is None
        node = _Node(session_id, parent_session_id, parent, family, orphan=orphan)
        if orphan:
            family.orphans += 1
        family.size += 1
        family.open_count += 1
        self._nodes[session_id] = node
        if parent is not None and parent.expected_children > 0:
            was = parent.declaring
            parent.expected_children -= 1
            self._declaring_changed(parent, was)

    def declare_branch(self, session_id: str, count: int | None = None) -> None:
        """Declare that this session's current (or, between turns, next) turn spawns children.

        `count` children are expected (each later registration under this session pays one
        off); `None` means "some": the declaration then lasts until the session begins its
        following turn or ends. Declare before computing the turn's context: a context that
        was already handed out cannot be taken back.
        """
        if count is not None and (isinstance(count, bool) or count < 0):
            raise ValueError(f"branch count must be a non-negative integer or None, got {count!r}")
        node = self._live(session_id)
        if count == 0:
            return
        was = node.declaring
        self._note_reopen(node.family)
        if count is None:
            node.open_decl_turn = node.turns if node.in_flight else node.turns + 1
        else:
            node.expected_children += count
        self._declaring_changed(node, was)

    # -- turns --------------------------------------------------------------------------

    def context_for(self, session_id: str, is_final_turn: bool) -> RoutingContext:
        """Begin a turn of `session_id` and return the context its request is stamped with."""
        node = self._live(session_id)
        family = node.family
        node.turns += 1
        node.in_flight = True
        if node.open_decl_turn is not None and node.open_decl_turn < node.turns:
            # An open-ended declaration covers only the turn it was made for.
            node.open_decl_turn = None
            self._declaring_changed(node, True)
        if not node.open:
            # A turn after the session's final one: it is active again, and so is its family.
            self._note_reopen(family)
            node.open = True
            family.open_count += 1
        parent = node.parent
        return RoutingContext(
            session_id=session_id,
            parent_session_id=node.parent_id,
            root_session_id=family.root_id,
            is_final_turn=is_final_turn,
            is_parent_final=None if parent is None else not parent.open,
            # Only this session is still open, nobody owes children, and the family's root and
            # every member are known: nothing else can follow this request.
            is_family_final=(
                is_final_turn
                and family.open_count == 1
                and family.declaring == 0
                and family.orphans == 0
                and family.has_root
            ),
        )

    def finish_turn(self, session_id: str, final: bool) -> bool:
        """End the current turn; True when `on_session_end` must fire now.

        Pass `final=True` only when a final turn completed (a failed final turn may be
        retried by the client, so it leaves the session open). Unknown or ended sessions
        (the turn raced with DELETE) are ignored.
        """
        node = self._nodes.get(session_id)
        if node is None:
            return False
        node.in_flight = False
        if not final:
            return False
        if node.open:
            node.open = False
            node.family.open_count -= 1
        return self._claim_notification(node)

    def end_session(self, session_id: str) -> bool:
        """Forget a session (DELETE, lost, expired); True when `on_session_end` must fire now."""
        node = self._nodes.pop(session_id, None)
        if node is None:
            return False
        family = node.family
        was = node.declaring
        node.expected_children = 0
        node.open_decl_turn = None
        self._declaring_changed(node, was)
        if node.open:
            node.open = False
            family.open_count -= 1
        node.ended = True
        node.in_flight = False
        if node.orphan:
            family.orphans -= 1
        family.size -= 1
        if family.size == 0 and self._families.get(family.root_id) is family:
            del self._families[family.root_id]
        # Children keep a reference to this node so their is_parent_final stays True.
        return self._claim_notification(node)

    def release_all(self) -> list[str]:
        """Shutdown: forget everything; return the ids whose `on_session_end` must still fire."""
        pending = [sid for sid, node in self._nodes.items() if not node.notified]
        for node in self._nodes.values():
            node.notified = True
            node.ended = True
            node.open = False
        self._nodes.clear()
        self._families.clear()
        return pending

    # -- queries ------------------------------------------------------------------------

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    def root_of(self, session_id: str) -> str:
        """Root id of a registered session (what family-level affinity hashes)."""
        return self._live(session_id).family.root_id

    def stats(self) -> FamilyStats:
        return FamilyStats(
            sessions=len(self._nodes), families=len(self._families), reopened=self._reopened
        )

    # -- internals ----------------------------------------------------------------------

    def _live(self, session_id: str) -> _Node:
        node = self._nodes.get(session_id)
        if node is None:
            raise UnknownSessionError(session_id)
        return node

    def _family(self, root_id: str) -> _Family:
        family = self._families.get(root_id)
        if family is None:
            family = self._families[root_id] = _Family(root_id)
        return family

    def _note_reopen(self, family: _Family) -> None:
        # Counted for /metrics: a family that had nothing outstanding becomes active again
        # (late child, turn after a final one, or a new declaration).
        if family.size > 0 and family.open_count == 0 and family.declaring == 0:
            self._reopened += 1

    @staticmethod
    def _declaring_changed(node: _Node, was: bool) -> None:
        now = node.declaring
        if now != was:
            node.family.declaring += 1 if now else -1

    @staticmethod
    def _claim_notification(node: _Node) -> bool:
        if node.notified:
            return False
        node.notified = True
        return True

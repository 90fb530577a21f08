"""Phase 1 of a TITO turn (docs/architecture.md): under the session lock, validate the
request's messages against the session's history and build the prompt ids.

Its own module because planning only reads the session and the request: it decides where the
turn attaches (a line's checkpoint, a tree's node) and what the engine is sent, and returns
all phases 2 and 3 need as one `Turn`. Nothing here talks to the engine.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sessiongate.errors import SessionNotFound
from sessiongate.session.messages import HistoryPlan, Message, MessageMatcher, plan_history
from sessiongate.session.settings import SessionSettings
from sessiongate.session.state import Session
from sessiongate.session.tito import TitoEngine
from sessiongate.session.tree import TreeNode, TreePlan
from sessiongate.session_routing.base import RoutingContext
from sessiongate.session_routing.stamper import SessionStamper


@dataclass(slots=True)
class TurnRequest:
    """A chat turn as the client asked for it, parsed and checked once."""

    session_id: str
    body: dict[str, Any]
    messages: list[Message]
    tools: Any
    template_kwargs: dict[str, Any]
    headers: list[tuple[str, str]]
    request_timestamp: float = field(default_factory=time.time)


@dataclass(slots=True)
class Turn:
    """What phases 2 and 3 of one TITO turn need from phase 1."""

    session: Session
    session_id: str
    version: int
    checkpoint_count: int
    base_len: int
    messages: list[Any]
    tools: Any
    prompt_ids: array[int]
    base_ids: Sequence[int]
    final_turn: bool
    template_kwargs: dict[str, Any]
    request_timestamp: float
    # The session routing mode's context of this turn (None: no mode).
    routing: RoutingContext | None = None
    r3_start_row: int = 0
    request_bytes: bytes = b""
    succeeded: bool = False  # a relayed turn: recorded and answered in full
    ended: bool = False  # a relayed turn: its end ran
    tree_parent: TreeNode | None = None  # tree mode: the node it attached to (None: a root)
    # A line session's rollback: how many assistant steps this turn replaces (0: none).
    rollback_steps: int = 0
    # A turn asked in another client API: its name and the client's body (the record's).
    dialect: str | None = None
    client_request: bytes | None = None


async def plan_turn(
    session: Session,
    request: TurnRequest,
    *,
    tito: TitoEngine,
    settings: SessionSettings,
    matcher: MessageMatcher,
    stamper: SessionStamper | None,
) -> Turn:
    """Plan the turn under the session lock and mark it started (the session is busy until
    the turn ends, whatever happens)."""
    session_id = request.session_id
    async with session.lock:
        if session.closing:
            raise SessionNotFound(f"session {session_id} is closing")
        plan, base_ids, last_assistant = _attach(session, request, settings, matcher)
        prompt_ids = _prompt_ids(tito, request, plan, base_ids, last_assistant)
        if session.tree is not None:
            session.tree.check_room(session_id)  # 409 at the node cap
        routing: RoutingContext | None = None
        final_turn = False
        if stamper is not None:
            routing, final_turn = stamper.begin_turn(session_id, request.headers)
        version = session.version
        session.turn_started()
        if session.tree is not None:
            session.tree.pending += 1  # released when the turn ends, whatever happens
        session.last_active = time.monotonic()
    return Turn(
        session=session,
        session_id=session_id,
        version=version,
        checkpoint_count=plan.checkpoint_count,
        rollback_steps=plan.rollback_steps if isinstance(plan, HistoryPlan) else 0,
        base_len=plan.base_len,
        # The stored spelling of the kept history (a loose matcher may have accepted a
        # re-serialised echo of it), then the appended messages.
        messages=plan.messages,
        tools=request.tools,
        template_kwargs=request.template_kwargs,
        prompt_ids=prompt_ids,
        base_ids=base_ids,
        final_turn=final_turn,
        request_timestamp=request.request_timestamp,
        routing=routing,
        # Addition R3: the checkpoint's rows (all but its last token's) are held already;
        # in a tree that is the attach node's checkpoint (rows since the branch point).
        r3_start_row=max(0, len(base_ids) - 1) if settings.r3_addition else 0,
        tree_parent=plan.attach if isinstance(plan, TreePlan) else None,
    )


def _attach(
    session: Session,
    request: TurnRequest,
    settings: SessionSettings,
    matcher: MessageMatcher,
) -> tuple[HistoryPlan | TreePlan, Sequence[int], Message | None]:
    """Where the turn attaches: its plan, the checkpoint ids it extends and the assistant
    message they end with (none for a first turn)."""
    if session.tree is not None:
        # Tree mode: attach at the deepest matching node; any node will do.
        plan = session.tree.plan_turn(
            request.messages,
            session_id=request.session_id,
            allowed_roles=settings.allowed_append_roles,
            matcher=matcher,
        )
        return plan, plan.base_ids, plan.last_assistant
    line = plan_history(
        session.messages,
        request.messages,
        session_id=request.session_id,
        allowed_roles=settings.allowed_append_roles,
        matcher=matcher,
        checkpoint_ends=session.checkpoint_ends,
        max_rollback=settings.max_rollback_steps,
    )
    if not line.checkpoint_count:
        return line, (), None
    return line, session.checkpoint(line.checkpoint_count), session.messages[line.base_len - 1]


def _prompt_ids(
    tito: TitoEngine,
    request: TurnRequest,
    plan: HistoryPlan | TreePlan,
    base_ids: Sequence[int],
    last_assistant: Message | None,
) -> array[int]:
    """The turn's prompt: a fresh render for a first turn, else the checkpoint's ids, the
    junction and the appended messages' ids.

    An int64 array, never a list: at long contexts boxing and copying the ids as Python ints
    was most of a turn's cost (docs/performance.md); the checkpoint is one already, so
    joining is a copy of memory and the upstream body is written straight from the buffer
    (rewrite_request)."""
    kwargs = request.template_kwargs
    if last_assistant is None:
        return array(
            "q", tito.first_turn_ids(request.messages, request.tools, template_kwargs=kwargs)
        )
    # Without a stop token the next message opens itself with (GLM 4.7).
    prompt_ids = array("q", tito.junction_prefix(base_ids))
    prompt_ids.extend(tito.junction_ids(base_ids, template_kwargs=kwargs))
    prompt_ids.extend(
        tito.appended_ids(last_assistant, plan.appended, request.tools, template_kwargs=kwargs)
    )
    return prompt_ids

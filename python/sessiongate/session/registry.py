"""Registry and limits of the session core: which sessions exist, how one is opened, created,
closed and expired, and the limits that refuse new ones (docs/reliability.md, "Limits").

Kept apart from what reads a session and from the turn so that every path that adds or ends
a session, and so every change of the counts the limits read, is in one file.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from sessiongate.engines.pool import EnginePool
from sessiongate.errors import (
    BadRequest,
    GatewayError,
    RecordsBudgetFull,
    SessionNotFound,
    TooManySessions,
)
from sessiongate.primitives import new_session_id, shard_key, validate_session_id
from sessiongate.process.memory import FreedMemoryTrimmer, release_free_memory
from sessiongate.protocol import CoreReply, CoreRequest, Op, json_reply, parse_json_object
from sessiongate.session.messages import resolve_matcher
from sessiongate.session.settings import SessionSettings
from sessiongate.session.state import Session
from sessiongate.session.store.records_store import RecordsStore, RecoveryReport
from sessiongate.session.tito import TitoEngine
from sessiongate.session.tree import SessionTree
from sessiongate.session.tree_hooks import load_hook
from sessiongate.session_routing.stamper import SessionStamper
from sessiongate.tokenizer import ChatTokenizer

logger = logging.getLogger(__name__)

# Ids of expired sessions remembered (newest kept), so a late GET, turn or DELETE learns why
# its session is gone; at most a few tens of MB even with 256-character ids.
EXPIRED_IDS_KEPT = 100_000


class SessionRegistry:
    """Sessions of one worker by id, their lifecycle and limits; the state every part of
    the core shares."""

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        upstream: EnginePool,
        settings: SessionSettings | None = None,
        stamper: SessionStamper | None = None,
        store: RecordsStore | None = None,
    ) -> None:
        self.settings = settings or SessionSettings()
        # Durable records (--records-dir), or None: in memory only.
        self.store = store
        # Stamps session identity for an external router (None: no session routing mode).
        self.stamper = stamper
        self.tito = TitoEngine(
            tokenizer,
            max_trim_tokens=self.settings.max_trim_tokens,
            chat_template_kwargs=self.settings.chat_template_kwargs,
            boundary_stop_tokens=self.settings.boundary_stop_tokens,
            end_of_turn_token=self.settings.end_of_turn_token,
            comparator=self.settings.tito_comparator,
        )
        self.upstream = upstream
        self.sessions: dict[str, Session] = {}
        self.matcher = resolve_matcher(self.settings.message_matcher)
        # Tree sessions' sample selection (loaded in any mode: recovered sessions may be trees).
        self.pick_hook = load_hook("pick", self.settings.tree_pick_hook)
        self.postprocess_hook = load_hook("postprocess", self.settings.tree_postprocess_hook)
        self.turns_recorded = 0
        self.turns_aborted = 0
        # Turns recorded without R3 under --r3-missing warn.
        self.r3_missing_turns = 0
        # Streamed turns served buffered under --stream-upstream relay because the engine's
        # stream drops logprobs (/health's relay_buffered_turns).
        self.relay_buffered_turns = 0
        # Bytes of every stored TurnRecord (TurnRecord.size) over all sessions, kept up to
        # date by each commit and close so the budget check never scans the sessions.
        self.records_bytes = 0
        # Freed records go back to the OS in batches (process/memory.py).
        self._trimmer = FreedMemoryTrimmer()
        self._tasks: set[asyncio.Future[None]] = set()
        # Requests refused by a limit, by reason ("max_sessions", "records_budget").
        self.rejected: Counter[str] = Counter()
        self.sessions_expired = 0
        # id -> idle TTL it expired under, oldest first (bounded by EXPIRED_IDS_KEPT).
        self.expired_ids: OrderedDict[str, float] = OrderedDict()
        # Called as hook(session_id, reason) exactly once per session when it ends.
        self.end_hooks: list[Callable[[str, str], None]] = []
        self._expiry: asyncio.Task[None] | None = None
        # Operation name -> handler, bound once (the class that assembles the core says).
        self._ops = self.operations()

    def operations(self) -> dict[str, Callable[[CoreRequest], Awaitable[CoreReply]]]:
        """The operations this core answers, by `CoreRequest.op`."""
        return {Op.CREATE: self._create, Op.DELETE: self._delete}

    def start(self) -> None:
        """Background work that needs a running loop (idempotent)."""
        self.upstream.start()
        ttls = [t for t in (self.settings.header_session_ttl, self.settings.session_ttl) if t > 0]
        if ttls and self._expiry is None:
            self._expiry = asyncio.create_task(self._expire_idle_sessions(min(ttls)))

    def recover(self) -> RecoveryReport | None:
        """Load the records directory's sessions (before serving: a worker reports ready
        only after this). Returns what was recovered, or None without a store."""
        if self.store is None:
            return None
        for session in self.store.recover():
            self.sessions[session.session_id] = session
            self.records_bytes += session.records_bytes
            if self.stamper is not None:
                self.stamper.register(session.session_id, session.parent_id)
        return self.store.recovery

    def _session_id(self, request: CoreRequest) -> str:
        if request.session_id is None:
            raise BadRequest(f"operation {request.op!r} needs a session id")
        try:
            return validate_session_id(request.session_id)
        except ValueError as exc:
            raise BadRequest(f"invalid session id: {exc}") from exc

    def _open_session(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise self._not_found(session_id)
        if session.closing:
            raise SessionNotFound(f"session {session_id} is closing")
        # Any request naming a session keeps it alive: a trainer fetching records between
        # turns must not lose them to the idle TTL.
        session.last_active = time.monotonic()
        return session

    def _not_found(self, session_id: str) -> SessionNotFound:
        ttl = self.expired_ids.get(session_id)
        if ttl is not None:
            return SessionNotFound(f"session {session_id} expired after {ttl:g} s idle")
        return SessionNotFound(f"session {session_id} not found{self.settings.not_found_note}")

    def _add_session(
        self, session_id: str, parent: Session | None, *, from_header: bool = False
    ) -> Session:
        limit = self.settings.max_sessions
        if limit and len(self.sessions) >= limit:
            self.rejected["max_sessions"] += 1
            raise TooManySessions(
                f"{self.settings.label} holds {len(self.sessions)} sessions, the limit "
                f"(--max-sessions {limit}); delete finished sessions"
            )
        # A header id may come back after its session expired: it is a new session now.
        self.expired_ids.pop(session_id, None)
        session = Session(
            session_id=session_id,
            parent_id=parent.session_id if parent else None,
            root_id=parent.root_id if parent else shard_key(session_id),
            created_at=time.time(),
            from_header=from_header,
            tree=SessionTree() if self.settings.session_mode == "tree" else None,
        )
        self.sessions[session_id] = session
        if self.store is not None:
            # Queued before any turn of the session: the writer keeps the order.
            session.opened = self.store.append_open(session)
        if parent is not None:
            parent.children.append(session_id)
        if self.stamper is not None:
            self.stamper.register(session_id, session.parent_id)
        return session

    def _forget_session(self, session: Session) -> None:
        """Undo _add_session for a session whose OPEN entry could not be written."""
        self.sessions.pop(session.session_id, None)
        parent = self.sessions.get(session.parent_id) if session.parent_id else None
        if parent is not None and session.session_id in parent.children:
            parent.children.remove(session.session_id)
        if self.stamper is not None:
            self.stamper.end(session.session_id)

    def limits_status(self) -> dict[str, Any]:
        """The limits (0 = off) and their usage, for /health and the worker heartbeat."""
        return {
            "max_sessions": self.settings.max_sessions,
            "records_bytes": self.records_bytes,
            "max_records_bytes": self.settings.max_records_bytes,
            "session_ttl": self.settings.session_ttl,
            "sessions_expired": self.sessions_expired,
            # The records store (--records-dir): bytes in RAM, records read from files.
            **self._store_status(),
            "rejected": {
                "max_sessions": self.rejected["max_sessions"],
                "records_budget": self.rejected["records_budget"],
            },
        }

    def _store_status(self) -> dict[str, int]:
        store = self.store
        if store is None:
            return {
                "records_resident_bytes": self.records_bytes,
                "records_memory": 0,
                "records_spilled": 0,
                "records_write_errors": 0,
            }
        return {
            "records_resident_bytes": store.resident.bytes,
            "records_memory": store.settings.memory_budget,
            "records_spilled": store.resident.spilled,
            "records_write_errors": store.write_errors,
        }

    def _check_records_budget(self) -> None:
        """Refuse a new turn while the records fill the budget. Turns already past this
        check still record their replies, so the total can pass the budget by the replies
        in flight: refusing them after the upstream did the work would waste it, and the
        client would retry the same turn anyway."""
        limit = self.settings.max_records_bytes
        # With a records directory, RAM holds at most --records-memory: the disk is the limit.
        if limit and self.store is None and self.records_bytes >= limit:
            self.rejected["records_budget"] += 1
            raise RecordsBudgetFull(
                f"records memory budget of {self.settings.label} is full ({self.records_bytes} "
                f"of {limit} bytes in {len(self.sessions)} sessions, --max-records-bytes); "
                "fetch and delete finished sessions"
            )

    async def _create(self, request: CoreRequest) -> CoreReply:
        parent: Session | None = None
        if request.body.strip():
            document = parse_json_object(request.body, "request body")
            parent_id = document.get("parent_session_id")
            if parent_id is not None:
                if not isinstance(parent_id, str):
                    raise BadRequest("field 'parent_session_id' must be a string")
                parent = self._open_session(parent_id)
        if request.session_id is not None:
            session_id = self._session_id(request)
            if session_id in self.sessions:
                raise BadRequest(f"session {session_id} already exists")
        else:
            session_id = new_session_id(parent.session_id if parent else None)
        session = self._add_session(session_id, parent)
        if session.opened is not None and self.store is not None:
            try:
                await self.store.settle(session.opened)
            except GatewayError:
                self._forget_session(session)
                raise
        return json_reply(200, {"session_id": session_id})

    async def _delete(self, request: CoreRequest) -> CoreReply:
        await self._close(self._open_session(self._session_id(request)), "deleted")
        return CoreReply(204, [])

    async def _close(self, session: Session, reason: str) -> None:
        """Every terminal path of a session (delete, idle expiry, shutdown) ends here."""
        session.closing = True
        # Wait for an in-flight turn so its reply is not cut off and nothing half-commits.
        await session.idle.wait()
        if self.sessions.pop(session.session_id, None) is None:
            return
        self.records_bytes -= session.records_bytes
        if self.store is not None:
            self.store.resident.drop(session.records)
            if reason != "shutdown":  # a shutdown keeps the files: the next start recovers
                await self.store.settle(self.store.remove(session.session_id))
        if self._trimmer.freed(session.records_bytes, idle=not self.sessions):
            self._background(self._trim_freed_memory())
        if session.parent_id is None:
            # A child talking later is placed again (the same engine under rendezvous
            # placement; the policy's pick otherwise: docs/routing.md, "Session families").
            self.upstream.forget(session.root_id)
        if self.stamper is not None:
            self.stamper.end(session.session_id)
        for hook in self.end_hooks:
            try:
                hook(session.session_id, reason)
            except Exception:  # a hook must not break session bookkeeping
                logger.exception("session end hook failed for %s", session.session_id)

    async def _trim_freed_memory(self) -> None:
        try:
            # Not while requests keep coming: their turns would reuse these pages warm.
            while (delay := self._trimmer.wait()) > 0:
                await asyncio.sleep(delay)
            await asyncio.to_thread(release_free_memory)
        finally:
            self._trimmer.done()

    def _background(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        # Keep a reference until done: the loop holds tasks only weakly.
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _expire_idle_sessions(self, shortest_ttl: float) -> None:
        # A session outlives its TTL by at most a quarter of it (30 s at most).
        while True:
            await asyncio.sleep(min(max(shortest_ttl / 4, 0.05), 30.0))
            try:
                await self.expire_idle(time.monotonic())
            except Exception:  # one bad close must not stop expiry for good
                logger.exception("idle session expiry failed; retrying next round")

    async def expire_idle(self, now: float) -> int:
        """Close the sessions idle longer than their TTL at monotonic time `now`: header
        sessions after --header-session-ttl, path-created ones after --session-ttl."""
        expired = 0
        for session in list(self.sessions.values()):
            ttl = (
                self.settings.header_session_ttl
                if session.from_header
                else self.settings.session_ttl
            )
            if (
                ttl > 0
                and not session.closing
                and session.inflight == 0
                and now - session.last_active > ttl
            ):
                await self._close(session, "expired")
                self.sessions_expired += 1
                expired += 1
                self.expired_ids[session.session_id] = ttl
                self.expired_ids.move_to_end(session.session_id)
                if len(self.expired_ids) > EXPIRED_IDS_KEPT:
                    self.expired_ids.popitem(last=False)
        return expired

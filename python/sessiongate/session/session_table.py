"""Registry and limits of the session core: which sessions exist, how one is opened, created,
closed and expired, and the limits that refuse new ones (docs/reliability.md, "Limits").

Kept apart from what reads a session and from the turn so that every path that adds or ends
a session, and so every change of the counts the limits read, is in one file. The other parts
of the core (reads.py, turn.py) are given the table and find their sessions through it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

from sessiongate.engines.pool import EnginePool
from sessiongate.errors import (
    BadRequest,
    GatewayError,
    RecordsBudgetFull,
    SessionGone,
    SessionNotFound,
    TooManySessions,
)
from sessiongate.primitives import new_session_id, shard_key, validate_session_id
from sessiongate.protocol import CoreReply, CoreRequest, json_reply, parse_json_object
from sessiongate.session.freed_memory import FreedMemory
from sessiongate.session.reclaimed import ReclaimedIds
from sessiongate.session.settings import SessionSettings
from sessiongate.session.state import Session
from sessiongate.session.store.records_store import RecordsStore, RecoveryReport
from sessiongate.session.tree import SessionTree
from sessiongate.session_routing.stamper import SessionStamper

logger = logging.getLogger(__name__)

# Ids of expired sessions remembered (newest kept), so a late GET, turn or DELETE learns why
# its session is gone; at most a few tens of MB even with 256-character ids.
EXPIRED_IDS_KEPT = 100_000


class SessionTable:
    """Sessions of one worker by id, their lifecycle and limits: the part of the core every
    other part finds its sessions through."""

    def __init__(
        self,
        settings: SessionSettings,
        upstream: EnginePool,
        memory: FreedMemory,
        *,
        stamper: SessionStamper | None = None,
        store: RecordsStore | None = None,
    ) -> None:
        # Replaced as a whole (`dataclasses.replace`) by a worker server that learns more
        # about its deployment; every part reads it from here.
        self.settings = settings
        # Durable records (--records-dir), or None: in memory only.
        self.store = store
        # Stamps session identity for an external router (None: no session routing mode).
        self.stamper = stamper
        # Told when a root session ends, so its family is placed again.
        self.upstream = upstream
        self.memory = memory
        self.sessions: dict[str, Session] = {}
        # Bytes of every stored TurnRecord (TurnRecord.size) over all sessions, kept up to
        # date by each commit and close so the budget check never scans the sessions.
        self.records_bytes = 0
        # Requests refused by a limit, by reason ("max_sessions", "records_budget").
        self.rejected: Counter[str] = Counter()
        self.sessions_expired = 0
        # id -> idle TTL it expired under, oldest first (bounded by EXPIRED_IDS_KEPT).
        self.expired_ids: OrderedDict[str, float] = OrderedDict()
        # Deleted ids, answered 410 for a while (session/reclaimed.py).
        self.reclaimed = ReclaimedIds(settings.reclaimed_ids, settings.reclaimed_ttl)
        # Called as hook(session_id, reason) exactly once per session when it ends.
        self.end_hooks: list[Callable[[str, str], None]] = []
        self._expiry: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Idle expiry, which needs a running loop (idempotent)."""
        ttls = [t for t in (self.settings.header_session_ttl, self.settings.session_ttl) if t > 0]
        if ttls and self._expiry is None:
            self._expiry = asyncio.create_task(self._expire_idle_sessions(min(ttls)))

    def recover(self) -> RecoveryReport | None:
        """Load the records directory's sessions (before serving: a worker reports ready
        only after this). Returns what was recovered, or None without a store."""
        if self.store is None:
            return None
        if self.reclaimed.enabled:
            self.reclaimed.load(self.store.read_reclaimed(), time.time())
        sessions = self.store.recover()
        for session in sessions:
            self.reclaimed.discard(session.session_id)  # created again since
        if self.reclaimed.enabled:
            self.store.rewrite_reclaimed(self.reclaimed.entries(time.time()))
        for session in sessions:
            self.sessions[session.session_id] = session
            self.records_bytes += session.records_bytes
            if self.stamper is not None:
                self.stamper.register(session.session_id, session.parent_id)
        return self.store.recovery

    async def aclose(self) -> None:
        """Shutdown: stop expiry, then end every session (hooks fire once each)."""
        if self._expiry is not None:
            self._expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry
        for session in list(self.sessions.values()):
            await self.close(session, "shutdown")

    def session_id(self, request: CoreRequest) -> str:
        """The request's session id, checked (400 when missing or invalid)."""
        if request.session_id is None:
            raise BadRequest(f"operation {request.op!r} needs a session id")
        try:
            return validate_session_id(request.session_id)
        except ValueError as exc:
            raise BadRequest(f"invalid session id: {exc}") from exc

    def open_session(self, session_id: str) -> Session:
        """The live session `session_id` (404 when unknown, expired or closing), kept
        alive by this request."""
        session = self.sessions.get(session_id)
        if session is None:
            raise self.not_found(session_id)
        if session.closing:
            raise SessionNotFound(f"session {session_id} is closing")
        # Any request naming a session keeps it alive: a trainer fetching records between
        # turns must not lose them to the idle TTL.
        session.last_active = time.monotonic()
        return session

    def not_found(self, session_id: str) -> SessionNotFound | SessionGone:
        """The 404 for an unknown id, saying so when it expired; the 410 for one deleted
        lately (--reclaimed-ttl)."""
        gone = self.gone(session_id)
        if gone is not None:
            return gone
        ttl = self.expired_ids.get(session_id)
        if ttl is not None:
            return SessionNotFound(f"session {session_id} expired after {ttl:g} s idle")
        return SessionNotFound(f"session {session_id} not found{self.settings.not_found_note}")

    def gone(self, session_id: str) -> SessionGone | None:
        """The 410 for a session deleted within --reclaimed-ttl, else None."""
        age = self.reclaimed.age(session_id, time.time())
        if age is None:
            return None
        return SessionGone(
            f"session {session_id} was deleted {age:.0f} s ago (reclaimed by its trainer); "
            "its records are gone"
        )

    def add_session(
        self, session_id: str, parent: Session | None, *, from_header: bool = False
    ) -> Session:
        limit = self.settings.max_sessions
        if limit and len(self.sessions) >= limit:
            self.rejected["max_sessions"] += 1
            raise TooManySessions(
                f"{self.settings.label} holds {len(self.sessions)} sessions, the limit "
                f"(--max-sessions {limit}); delete finished sessions"
            )
        # A header id may come back after its session expired, and an id deleted may be
        # created again on purpose: it is a new session now.
        self.expired_ids.pop(session_id, None)
        self.reclaimed.discard(session_id)
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
        """Undo add_session for a session whose OPEN entry could not be written."""
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

    def check_records_budget(self) -> None:
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

    async def create(self, request: CoreRequest) -> CoreReply:
        parent: Session | None = None
        if request.body.strip():
            document = parse_json_object(request.body, "request body")
            parent_id = document.get("parent_session_id")
            if parent_id is not None:
                if not isinstance(parent_id, str):
                    raise BadRequest("field 'parent_session_id' must be a string")
                parent = self.open_session(parent_id)
        if request.session_id is not None:
            session_id = self.session_id(request)
            if session_id in self.sessions:
                raise BadRequest(f"session {session_id} already exists")
        else:
            session_id = new_session_id(parent.session_id if parent else None)
        session = self.add_session(session_id, parent)
        if session.opened is not None and self.store is not None:
            try:
                await self.store.settle(session.opened)
            except GatewayError:
                self._forget_session(session)
                raise
        return json_reply(200, {"session_id": session_id})

    async def delete(self, request: CoreRequest) -> CoreReply:
        session_id = self.session_id(request)
        await self.close(self.open_session(session_id), "deleted")
        if self.reclaimed.enabled:
            now = time.time()
            self.reclaimed.add(session_id, now)
            if self.store is not None:
                # Best effort, like the file's removal before it: a lost line costs a 404
                # instead of a 410 after a restart, nothing else.
                self.store.append_reclaimed(session_id, now).add_done_callback(_log_failure)
        return CoreReply(204, [])

    async def close(self, session: Session, reason: str) -> None:
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
        self.memory.freed(session.records_bytes, idle=not self.sessions)
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
                await self.close(session, "expired")
                self.sessions_expired += 1
                expired += 1
                self.expired_ids[session.session_id] = ttl
                self.expired_ids.move_to_end(session.session_id)
                if len(self.expired_ids) > EXPIRED_IDS_KEPT:
                    self.expired_ids.popitem(last=False)
        return expired


def _log_failure(future: concurrent.futures.Future[None]) -> None:
    exc = future.exception()
    if exc is not None:
        logger.warning("could not write a reclaimed session id to the records directory: %s", exc)

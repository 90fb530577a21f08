"""The session core: HTTP-agnostic handling of every session operation.

Each operation takes a `CoreRequest` (the same fields the IPC request meta carries) and
returns a `CoreReply` (status, headers, body bytes or a stream of chunks), so the in-process
app and the multi-process workers run exactly this code.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from array import array
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import quote

from sessiongate.errors import (
    BadRequest,
    GatewayError,
    LimitReached,
    RecordsBudgetFull,
    SessionNotFound,
    TooManySessions,
    UpstreamError,
)
from sessiongate.http.forwarding import forwardable_headers
from sessiongate.primitives import new_session_id, rewrite_request, shard_key, validate_session_id
from sessiongate.process.memory import FreedMemoryTrimmer, release_free_memory
from sessiongate.protocol import (
    JSON_HEADERS,
    RECORDED_HEADER,
    SSE_HEADERS,
    CoreReply,
    CoreRequest,
    Op,
    error_reply,
    json_reply,
    parse_json_object,
    upstream_required,
)
from sessiongate.session.messages import (
    HistoryPlan,
    plan_history,
    resolve_matcher,
    validate_messages,
)
from sessiongate.session.reply import ParsedReply, finish_reason_text, parse_reply
from sessiongate.session.request_checks import check_turn_fields
from sessiongate.session.samples import build_samples_payload
from sessiongate.session.settings import SessionSettings
from sessiongate.session.state import Session, TurnRecord
from sessiongate.session.store.records_store import RecordsStore, RecoveryReport
from sessiongate.session.store.spilled import SpilledRecord, pin_files
from sessiongate.session.store.turn_entry import TreeLink, TurnEntry, span_in
from sessiongate.session.stream import (
    DONE,
    ClosingStream,
    SseEvents,
    StreamedTurn,
    error_event,
    sse,
)
from sessiongate.session.tito import TitoEngine
from sessiongate.session.trajectory import build_trajectory
from sessiongate.session.tree import SessionTree, TreeNode, TreePlan, leading_id
from sessiongate.session.tree_export import (
    TreeSnapshot,
    tree_samples_payload,
    tree_trajectory_parts,
)
from sessiongate.session.tree_hooks import load_hook
from sessiongate.session_routing.stamper import SessionStamper
from sessiongate.tokenizer import ChatTokenizer
from sessiongate.upstream import UpstreamPool
from sessiongate.upstream.client import UpstreamReply, UpstreamStream

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

# Proxied replies with a declared length below this are read whole and relayed in one frame.
PROXY_BUFFER_BELOW = 256 * 1024
# Session dumps at least this large are streamed in parts instead of joined.
STREAM_GET_ABOVE = 1024 * 1024
# Ids of expired sessions remembered (newest kept), so a late GET, turn or DELETE learns why
# its session is gone; at most a few tens of MB even with 256-character ids.
EXPIRED_IDS_KEPT = 100_000


class SessionCore:
    """Sessions of one worker: a registry, the TITO engine, and one upstream client."""

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        upstream: UpstreamPool,
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
        self._ops: dict[str, Callable[[CoreRequest], Awaitable[CoreReply]]] = {
            Op.HEALTH: self._health,
            Op.CREATE: self._create,
            Op.GET: self._get,
            Op.DELETE: self._delete,
            Op.CHAT: self._chat,
            Op.PROXY: self._proxy,
            Op.TRAJECTORY: self._trajectory,
            Op.SAMPLES: self._samples,
        }

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

    async def handle(self, request: CoreRequest) -> CoreReply:
        self.start()
        if request.op is not Op.HEALTH:  # health checks come on a timer, not with work
            self._trimmer.active()
        handler = self._ops.get(request.op)
        if handler is None:
            return error_reply(BadRequest(f"unknown operation {request.op!r}"))
        try:
            return await handler(request)
        except LimitReached as error:
            reply = error_reply(error)
            reply.headers.append(("retry-after", str(error.retry_after)))
            return reply
        except GatewayError as error:
            return error_reply(error)

    async def aclose(self) -> None:
        """Shutdown: end every session (hooks fire once each), then close the upstreams."""
        if self._expiry is not None:
            self._expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry
        for session in list(self.sessions.values()):
            await self._close(session, "shutdown")
        # A trim still waiting for a quiet spell is moot once the process is ending.
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.stamper is not None:
            self.stamper.release_all()
        await self.upstream.aclose()
        if self.store is not None:
            await asyncio.to_thread(self.store.close)

    # -- lookups -------------------------------------------------------------------------

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

    # -- operations ----------------------------------------------------------------------

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

    async def _health(self, request: CoreRequest) -> CoreReply:
        document: dict[str, object] = {
            "status": "ok",
            "sessions": len(self.sessions),
            "turns_recorded": self.turns_recorded,
            "turns_aborted": self.turns_aborted,
            "r3_missing_turns": self.r3_missing_turns,
            "relay_buffered_turns": self.relay_buffered_turns,
            **self.limits_status(),
            **self.upstream.status(),  # "upstream": "ok" | "down", "upstreams": [...]
        }
        status = 200
        if self.upstream.all_down:
            # 200 by default: restarting the gateway cannot fix the engine and would drop every
            # session's records (docs/reliability.md, "Upstream outages").
            document["status"] = "degraded"
            document["reason"] = self.upstream.down_reason()
            status = 503 if upstream_required(request.query) else 200
        return json_reply(status, document)

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

    async def _snapshot(
        self, request: CoreRequest
    ) -> tuple[Session, list[TurnRecord], list[int], dict[str, Any], TreeSnapshot | None]:
        """A consistent copy of a session's records and ids, with the TITO metadata that a
        fresh render of its history gives (computed off the event loop). A tree session's
        records and ids are its active path's (ending at the latest committed node), and the
        whole tree comes too (`metadata.tree`, and the snapshot)."""
        session = self._open_session(self._session_id(request))
        tree: TreeSnapshot | None = None
        async with session.lock:
            if session.tree is not None:
                tree = TreeSnapshot.take(session)
                records, messages, accumulated, tools, template_kwargs = tree.active_view()
            else:
                records = pin_files(session.records)
                messages = list(session.messages)
                accumulated = list(session.accumulated_ids)
                tools = session.tools
                template_kwargs = session.template_kwargs
        metadata: dict[str, Any] = {"max_trim_tokens": self.tito.max_trim_tokens}
        if accumulated:
            try:
                metadata["tito_session_mismatch"] = await asyncio.to_thread(
                    functools.partial(self.tito.mismatches, template_kwargs=template_kwargs),
                    messages,
                    tools,
                    accumulated,
                )
            except (GatewayError, ValueError) as exc:
                metadata["tito_session_mismatch_error"] = str(exc)
        if tree is not None:
            metadata["tree"] = tree.table
        return session, records, accumulated, metadata, tree

    async def _get(self, request: CoreRequest) -> CoreReply:
        session, records, accumulated, tito, _ = await self._snapshot(request)
        metadata: dict[str, Any] = {
            "accumulated_token_ids": accumulated,
            **tito,
            "parent_session_id": session.parent_id,
            "child_session_ids": list(session.children),
            "num_turns": len(records),
        }
        head = json.dumps({"session_id": session.session_id}, separators=(",", ":")).encode()
        meta = json.dumps(metadata, ensure_ascii=False, separators=(",", ":")).encode()
        parts = _session_document_parts(head[:-1], records, meta)
        if sum(r.size for r in records) < STREAM_GET_ABOVE:
            return CoreReply(200, list(JSON_HEADERS), b"".join([p async for p in parts]))
        # Large sessions go out record by record: never one buffer the size of the dump.
        return CoreReply(200, list(JSON_HEADERS), stream=parts, coalesce=True)

    async def _trajectory(self, request: CoreRequest) -> CoreReply:
        session, records, accumulated, metadata, tree = await self._snapshot(request)
        if tree is not None:
            # One trajectory per leaf the pick hook keeps, in its order.
            parts = await asyncio.to_thread(
                tree_trajectory_parts,
                session.session_id,
                tree,
                metadata,
                self.tito,
                pick=self.pick_hook,
                r3_topk=self.settings.r3_topk,
            )
        else:
            parts = await asyncio.to_thread(
                build_trajectory,
                session.session_id,
                records,
                accumulated,
                metadata,
                r3_topk=self.settings.r3_topk,
            )
        headers = [
            ("content-type", "application/octet-stream"),
            (
                "content-disposition",
                f'attachment; filename="{quote(session.session_id, safe="")}.safetensors"',
            ),
        ]
        if sum(memoryview(p).nbytes for p in parts) < STREAM_GET_ABOVE:
            return CoreReply(200, headers, b"".join(parts))

        async def stream() -> AsyncIterator[bytes]:
            for part in parts:
                yield bytes(part)

        return CoreReply(200, headers, stream=stream(), coalesce=True)

    async def _samples(self, request: CoreRequest) -> CoreReply:
        """Trainer-ready samples, assembled here as the rollout framework's session server
        does (docs/samples.md)."""
        max_seq_len: int | None = None
        agent: object = None
        if request.body.strip():
            document = parse_json_object(request.body, "request body")
            max_seq_len = document.get("max_seq_len")
            # Any integer: zero or less cuts every turn away, a 200 with `all_truncated`, as
            # the framework's turn-boundary truncation does (docs/samples.md).
            if max_seq_len is not None and (
                not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool)
            ):
                raise BadRequest("field 'max_seq_len' must be an integer or null")
            agent = document.get("metadata")  # tree sessions: the agent's, for the hooks
        _, records, accumulated, metadata, tree = await self._snapshot(request)
        session_metadata = {
            **metadata,
            "accumulated_token_ids": accumulated,
        }
        if tree is not None:
            if agent is not None:
                if not isinstance(agent, dict):
                    raise BadRequest("field 'metadata' must be an object or null")
                session_metadata["agent"] = agent
            payload = await asyncio.to_thread(
                functools.partial(
                    tree_samples_payload,
                    pick=self.pick_hook,
                    postprocess=self.postprocess_hook,
                    max_seq_len=max_seq_len,
                    r3_topk=self.settings.r3_topk,
                    indexer_topk=self.settings.indexer_topk,
                ),
                tree,
                session_metadata,
                self.tito,
            )
            return CoreReply(200, [("content-type", "application/octet-stream")], payload)
        payload = await asyncio.to_thread(
            build_samples_payload,
            records,
            accumulated,
            session_metadata,
            tokenizer=self.tito.tokenizer,
            max_trim_tokens=self.tito.max_trim_tokens,
            max_seq_len=max_seq_len,
            r3_topk=self.settings.r3_topk,
            indexer_topk=self.settings.indexer_topk,
        )
        return CoreReply(200, [("content-type", "application/octet-stream")], payload)

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
            # Pins are rendezvous-derived, so a child created later re-pins identically.
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

    async def _proxy(self, request: CoreRequest) -> CoreReply:
        root_id = None
        headers = request.headers
        if request.session_id is not None:
            session_id = self._session_id(request)
            root_id = self._open_session(session_id).root_id
            if self.settings.smg_routing_key:
                # The rollout framework stamps its session proxy requests too.
                headers = [
                    *(h for h in headers if h[0].lower() != "x-smg-routing-key"),
                    ("X-SMG-Routing-Key", session_id),
                ]
        stream = await self.upstream.open_stream(
            root_id,
            request.method,
            request.path,
            query=request.query,
            headers=headers,
            body=request.body,
        )
        if stream.small_body_length(PROXY_BUFFER_BELOW) is not None:
            # A small, declared-length body is cheaper to relay whole than as a stream.
            return CoreReply(stream.status, stream.headers, await stream.read_all())
        return CoreReply(stream.status, stream.headers, stream=stream.chunks())

    async def _chat(self, request: CoreRequest) -> CoreReply:
        request_timestamp = time.time()
        session_id = self._session_id(request)
        body = parse_json_object(request.body, "request body")
        check_turn_fields(body)
        messages = validate_messages(body.get("messages"))
        tools = body.get("tools")
        wants_stream = bool(body.get("stream"))
        relay = wants_stream and self.settings.stream_upstream == "relay"
        template_kwargs = self.tito.resolve_chat_template_kwargs(body.get("chat_template_kwargs"))

        session = self.sessions.get(session_id)
        if session is None and not request.auto_create:
            raise self._not_found(session_id)
        # Before the session is created and long before the upstream is asked: a refused
        # turn costs the engine nothing and leaves no empty session behind.
        self._check_records_budget()
        if session is None:
            session = self._add_session(session_id, None, from_header=True)

        # Phase 1, under the session lock: validate against the history and build the prompt.
        async with session.lock:
            if session.closing:
                raise SessionNotFound(f"session {session_id} is closing")
            tree_parent: TreeNode | None = None
            plan: HistoryPlan | TreePlan
            if session.tree is not None:
                # Tree mode: attach at the deepest matching node; any node will do.
                plan = session.tree.plan_turn(
                    messages,
                    session_id=session_id,
                    allowed_roles=self.settings.allowed_append_roles,
                    matcher=self.matcher,
                )
                tree_parent = plan.attach
                base_ids: Sequence[int] = plan.base_ids
                last_assistant = plan.last_assistant
            else:
                plan = plan_history(
                    session.messages,
                    messages,
                    session_id=session_id,
                    allowed_roles=self.settings.allowed_append_roles,
                    matcher=self.matcher,
                    checkpoint_ends=session.checkpoint_ends,
                )
                base_ids, last_assistant = (), None
                if plan.checkpoint_count:
                    base_ids = session.checkpoint(plan.checkpoint_count)
                    last_assistant = session.messages[plan.base_len - 1]
            # An int64 array, never a list: at long contexts boxing and copying the ids as
            # Python ints was most of a turn's cost (docs/performance.md); the checkpoint is
            # one already, so joining is a copy of memory and the upstream body is written
            # straight from the buffer (rewrite_request).
            if last_assistant is None:
                prompt_ids = array(
                    "q", self.tito.first_turn_ids(messages, tools, template_kwargs=template_kwargs)
                )
            else:
                # Without a stop token the next message opens itself with (GLM 4.7).
                prompt_ids = array("q", self.tito.junction_prefix(base_ids))
                prompt_ids.extend(self.tito.junction_ids(base_ids, template_kwargs=template_kwargs))
                prompt_ids.extend(
                    self.tito.appended_ids(
                        last_assistant, plan.appended, tools, template_kwargs=template_kwargs
                    )
                )
            if session.tree is not None:
                session.tree.check_room(session_id)  # 409 at the node cap
            routing_headers: list[tuple[str, str]] = []
            final_turn = False
            if self.stamper is not None:
                routing_ctx, final_turn = self.stamper.begin_turn(session_id, request.headers)
            version = session.version
            session.turn_started()
            if session.tree is not None:
                session.tree.pending += 1  # released by _end_turn, whatever happens
            session.last_active = time.monotonic()

        turn = _Turn(
            session=session,
            session_id=session_id,
            version=version,
            checkpoint_count=plan.checkpoint_count,
            base_len=plan.base_len,
            # The stored spelling of the kept history (a loose matcher may have accepted a
            # re-serialised echo of it), then the appended messages.
            messages=plan.messages,
            tools=tools,
            template_kwargs=template_kwargs,
            prompt_ids=prompt_ids,
            base_ids=base_ids,
            final_turn=final_turn,
            request_timestamp=request_timestamp,
            # Addition R3: the checkpoint's rows (all but its last token's) are held already;
            # in a tree that is the attach node's checkpoint (rows since the branch point).
            r3_start_row=max(0, len(base_ids) - 1) if self.settings.r3_addition else 0,
            tree_parent=tree_parent,
        )
        handed_off = False  # a relayed stream ends the turn itself
        succeeded = False
        try:
            # Phase 2, no lock: the upstream call.
            if relay and not await self._stream_is_exact(session.root_id):
                relay = False
            fields = self._upstream_fields(turn, template_kwargs, relay=relay)
            if self.stamper is not None:
                routing_headers = self.stamper.headers(routing_ctx)
            if self.stamper is not None and self.stamper.mutates_body:
                stamped: bytes | None = None
                if self.stamper.has_bytes_path:
                    # dynamo_nvext: splice its member into the client's bytes, then add the
                    # TITO fields (parse-equal to the other order, and the splice does not
                    # have to scan the prompt ids); neither step re-serialises the body.
                    spliced = await _off_loop(
                        self.stamper.transform_bytes, request.body, routing_ctx
                    )
                    if spliced is not None:
                        stamped = await _off_loop(rewrite_request, spliced, fields)
                if stamped is None:
                    # Modes with an object rewrite only work on the parsed body, re-serialised.
                    # Modes see the ids as the list the body's JSON holds.
                    plain = {**fields, "input_ids": turn.prompt_ids.tolist()}
                    upstream_body = self.stamper.transform({**body, **plain}, routing_ctx)
                    stamped = json.dumps(
                        upstream_body, ensure_ascii=False, separators=(",", ":")
                    ).encode()
                turn.request_bytes = stamped
            else:
                # No body rewrite: the client's bytes plus the TITO fields, never re-serialised.
                turn.request_bytes = await _off_loop(rewrite_request, request.body, fields)
            headers = self._turn_headers(session_id, request.headers, routing_headers)
            if relay:
                upstream = await self.upstream.open_stream(
                    session.root_id,
                    "POST",
                    self.settings.chat_path,
                    headers=[("content-type", "application/json"), *headers],
                    body=turn.request_bytes,
                )
                if upstream.status == 200 and upstream.is_event_stream():
                    handed_off = True
                    stream = ClosingStream(
                        self._relay_turn(turn, upstream, _wants_usage(body)),
                        lambda: self._end_relay(turn, upstream),
                    )
                    return CoreReply(200, SSE_HEADERS, stream=stream)
                # An error status passes through; a 200 that is not a stream is a whole reply.
                reply = UpstreamReply(upstream.status, upstream.headers, await upstream.read_all())
            else:
                reply = await self.upstream.post_json(
                    session.root_id, self.settings.chat_path, turn.request_bytes, headers
                )
            if reply.status != 200:
                # Upstream errors pass through unrecorded.
                return CoreReply(reply.status, reply.headers, reply.body)
            parsed = await _off_loop(parse_reply, reply.body)
            recorded = await self._commit(turn, reply.body, parsed)
            succeeded = True
        finally:
            if not handed_off:
                await self._end_turn(turn, succeeded)

        extra = [(RECORDED_HEADER, "true" if recorded else "false")]
        if wants_stream:
            # The turn is complete, so its one event goes out as one sized body, as the
            # framework's does (no chunked framing).
            sse = await _off_loop(_one_chunk_sse, parsed.client_body)
            return CoreReply(200, [*SSE_HEADERS, *extra], sse)
        return CoreReply(200, [*JSON_HEADERS, *extra], parsed.client_body)

    async def _stream_is_exact(self, root_id: str) -> bool:
        """Whether the engine's chat stream carries a logprob for every sampled token.

        SGLang 0.5.23 attaches a stream step's logprobs to its text chunk, and a step without
        text (the stop token, a token inside a multi-byte character) has none, so its
        logprobs are sent only by an engine with a reasoning or tool-call parser, which
        flushes them in a chunk of their own (serving_chat.py `_generate_stream_content`).
        The engine's `/model_info` names its parsers. Against an engine without one the turn
        is served buffered (exact, one chunk) rather than relayed and then refused; an
        upstream without `/model_info` is relayed, and the reply check still refuses a
        stream that comes up short.
        """
        info = await self.upstream.model_info(root_id)
        if info is None or info.get("reasoning_parser") or info.get("tool_call_parser"):
            return True
        if not self.relay_buffered_turns:
            logger.warning(
                "--stream-upstream relay: the engine runs no reasoning or tool-call parser, "
                "so its chat stream drops the logprobs of steps without text; streamed turns "
                'are served buffered (docs/api.md, "Streamed turns")'
            )
        self.relay_buffered_turns += 1
        return False

    def _upstream_fields(
        self, turn: _Turn, template_kwargs: dict[str, Any], *, relay: bool
    ) -> dict[str, Any]:
        """The members a session turn sets in the client's body (docs/api.md, "Upstream")."""
        fields: dict[str, Any] = {
            "input_ids": turn.prompt_ids,
            "logprobs": True,
            "no_stop_trim": False,
        }
        if relay:
            # SGLang rejects return_meta_info with stream (400) and streams no meta_info:
            # ask for the extras a stream can carry instead (session/stream.py).
            fields["stream"] = True
            fields["return_meta_info"] = False
            fields["return_output_ids_in_sglext"] = True
            fields["stream_options"] = {"include_usage": True}
            # The usage chunk has cached tokens only with --enable-cache-report; sglext has
            # them when asked (none when nothing was cached).
            fields["return_cached_tokens_details"] = True
        else:
            fields["stream"] = False
            fields["return_meta_info"] = True
            fields["stream_options"] = None  # only valid with stream
        if self.settings.r3:
            fields["return_routed_experts"] = True
            if self.settings.r3_addition:
                fields["routed_experts_start_len"] = turn.r3_start_row
        if self.settings.indexer_replay:
            fields["return_indexer_topk"] = True
        if self.settings.lora_path is not None:
            fields["lora_path"] = self.settings.lora_path
        if template_kwargs:
            # The engine's parsers (reasoning, tools) must see what the prompt was built with.
            fields["chat_template_kwargs"] = template_kwargs
        return fields

    def _turn_headers(
        self,
        session_id: str,
        client: list[tuple[str, str]],
        routing: list[tuple[str, str]],
    ) -> list[tuple[str, str]]:
        """The client's headers (less hop-by-hop ones and the body's own), the default
        routing key, then the routing mode's headers; later ones replace same-named ones."""
        stamped: list[tuple[str, str]] = []
        if self.settings.smg_routing_key:
            stamped.append(("X-SMG-Routing-Key", session_id))
        stamped.extend(routing)
        replaced = {name.lower() for name, _ in stamped} | {"content-type"}
        kept = [(k, v) for k, v in forwardable_headers(client) if k.lower() not in replaced]
        return [*kept, *stamped]

    def _check_reply(self, parsed: ParsedReply) -> None:
        """Contract checks that depend on this gateway's settings."""
        if self.settings.r3 and parsed.routed_experts is None:
            if self.settings.r3_missing == "error":
                raise UpstreamError(
                    "upstream reply has no routed_experts although --r3 asked for them (start "
                    "SGLang with --enable-return-routed-experts, or serve with --r3-missing "
                    "warn to record such turns anyway)"
                )
            self.r3_missing_turns += 1
            logger.warning(
                "turn recorded without routed_experts (%d so far)", self.r3_missing_turns
            )

    async def _commit(self, turn: _Turn, reply_body: bytes, parsed: ParsedReply) -> bool:
        """Phase 3, under the lock again: record the turn unless the session moved on."""
        self._check_reply(parsed)
        session = turn.session
        async with session.lock:
            # A tree takes concurrent turns as siblings; a line records the first one only.
            raced = session.tree is None and session.version != turn.version
            if session.closing or raced:
                return False
            new_ids = array("q", turn.prompt_ids)
            new_ids.extend(parsed.completion_ids)
            if turn.base_ids:
                self.tito.check_extends(turn.base_ids, new_ids, turn.session_id)
            kept = turn.checkpoint_count
            finish = finish_reason_text(parsed.finish_reason)
            record = TurnRecord(
                timestamp=time.time(),
                method="POST",
                path=self.settings.chat_path,
                status_code=200,
                request=turn.request_bytes,
                response=reply_body,
                prompt_len=len(turn.prompt_ids),
                completion_ids=array("i", parsed.completion_ids),
                logprobs=array("d", parsed.logprobs),
                finish_reason=finish,
                routed_experts=parsed.routed_experts,
                r3_start_row=turn.r3_start_row,
                indexer_topk=parsed.indexer_topk,
                weight_version=parsed.weight_version,
                cached_tokens=parsed.cached_tokens,
                e2e_latency=parsed.e2e_latency,
                request_timestamp=turn.request_timestamp,
            )
            messages = [*turn.messages, parsed.assistant_message]
            tree = session.tree
            link = None
            if tree is not None:
                link = TreeLink(
                    len(tree.nodes),
                    turn.tree_parent.id if turn.tree_parent is not None else None,
                    leading_id(reply_body),
                )
            if self.store is not None:
                # Written (per --records-durability) before anything changes: a turn the
                # disk refused is not recorded at all.
                await _persist_turn(self.store, turn, record, messages, reply_body, parsed, link)
            if tree is not None and link is not None:
                tree.add(
                    turn.tree_parent,
                    delta_messages=messages[turn.base_len :],
                    segment=array("q", new_ids[len(turn.base_ids) :]),
                    prompt_len=len(turn.prompt_ids),
                    finish_reason=finish,
                    response_id=link.response_id,
                    committed_at=record.timestamp,
                    tools=turn.tools,
                    template_kwargs=turn.template_kwargs,
                )
                # Node i's record is records[i]: appended, never replaced.
                session.records.append(record)
                change = record.size
            else:
                session.messages = messages
                session.commit_checkpoint(kept, new_ids)
                session.checkpoint_ends = [*session.checkpoint_ends[:kept], len(messages)]
                # A rollback replaces the records past the kept checkpoints: they stop counting.
                dropped = sum(r.size for r in session.records[kept:])
                if self.store is not None:
                    self.store.resident.drop(session.records[kept:])
                session.records = [*session.records[:kept], record]
                change = record.size - dropped
            session.records_bytes += change
            self.records_bytes += change
            session.tools = turn.tools
            session.template_kwargs = turn.template_kwargs
            session.version += 1
            self.turns_recorded += 1
            if finish == "abort":
                self.turns_aborted += 1
            if self.store is not None:
                # Spilled bodies are freed memory like a closed session's: give it back.
                freed = self.store.resident.enforce()
                if freed and self._trimmer.freed(freed):
                    self._background(self._trim_freed_memory())
            return True

    async def _end_turn(self, turn: _Turn, succeeded: bool) -> None:
        self._trimmer.active()
        async with turn.session.lock:
            if self.stamper is not None:
                self.stamper.finish_turn(
                    turn.session_id, final=turn.final_turn, succeeded=succeeded
                )
            turn.session.turn_finished()
            if turn.session.tree is not None:
                turn.session.tree.pending -= 1
            turn.session.last_active = time.monotonic()

    async def _relay_turn(
        self, turn: _Turn, upstream: UpstreamStream, client_wants_usage: bool
    ) -> AsyncIterator[bytes]:
        """The client's SSE stream of a relayed turn; records the turn at its end.

        Events go out as they arrive, except the sglext chunk (R3 and ids are the record's)
        and a usage chunk the client did not ask for. At the upstream's `[DONE]` the turn's
        non-stream reply is rebuilt, checked like any reply and recorded before the client's
        `[DONE]`. A failure after the 200 went out can only be told in the stream: an
        `{"error": ...}` event, and the turn is not recorded.
        """
        try:
            events = SseEvents()
            streamed = StreamedTurn(client_wants_usage=client_wants_usage)
            async for piece in upstream.raw_chunks():
                for data in events.feed(piece):
                    relayed = streamed.feed(data)
                    if relayed is not None:
                        yield sse(relayed)
            reply_body = streamed.reply()
            parsed = await _off_loop(parse_reply, reply_body)
            await self._commit(turn, reply_body, parsed)
            turn.succeeded = True  # recorded (or raced): a client gone now changes nothing
            yield sse(DONE)
        except GatewayError as exc:
            yield error_event(str(exc))
        finally:
            await self._end_relay(turn, upstream)

    async def _end_relay(self, turn: _Turn, upstream: UpstreamStream) -> None:
        """Ends a relayed turn once, from the relay's own end or from its reply stream's
        `aclose` when the relay never started."""
        if turn.ended:
            return
        turn.ended = True
        await upstream.aclose()
        await self._end_turn(turn, turn.succeeded)


@dataclass(slots=True)
class _Turn:
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
    r3_start_row: int = 0
    request_bytes: bytes = b""
    succeeded: bool = False  # a relayed turn: recorded and answered in full
    ended: bool = False  # a relayed turn: _end_relay ran
    tree_parent: TreeNode | None = None  # tree mode: the node it attached to (None: a root)


async def _persist_turn(
    store: RecordsStore,
    turn: _Turn,
    record: TurnRecord,
    messages: list[Any],
    reply_body: bytes,
    parsed: ParsedReply,
    link: TreeLink | None,
) -> None:
    """Append the turn's entry; acknowledged as --records-durability says. The record is
    then counted against the RAM budget (located once its write is done)."""
    entry = TurnEntry(
        kept=turn.checkpoint_count,
        base_len=turn.base_len,
        messages=messages[turn.base_len :],
        tools=turn.tools,
        template_kwargs=turn.template_kwargs,
        prompt_tail=array("q", turn.prompt_ids[len(turn.base_ids) :]),
        record=record,
        routed_span=span_in(reply_body, parsed.routed_experts, b"routed_experts"),
        indexer_span=span_in(reply_body, parsed.indexer_topk, b"indexer_topk"),
        tree=link,
    )
    future, location_of = store.append_turn(turn.session_id, entry)
    offset = await store.settle(future)
    resident = store.resident
    if offset is not None:
        resident.add(turn.session, record, location_of(offset))
        return
    resident.add(turn.session, record, None)
    loop = asyncio.get_running_loop()

    def written(done: Any) -> None:
        if not done.cancelled() and done.exception() is None:
            located = location_of(done.result())
            with contextlib.suppress(RuntimeError):  # the loop closed at shutdown
                loop.call_soon_threadsafe(resident.located, record, located)

    future.add_done_callback(written)


async def _session_document_parts(
    head: bytes, records: list[TurnRecord], metadata: bytes
) -> AsyncIterator[bytes]:
    yield head + b',"records":['
    for index, record in enumerate(records):
        if index:
            yield b","
        if isinstance(record, SpilledRecord):
            async for chunk in record.json_chunks():  # from its file, off the event loop
                yield chunk
            continue
        for part in record.json_parts():
            yield part
    yield b'],"metadata":' + metadata + b"}"


def _one_chunk_sse(client_body: bytes) -> bytes:
    """A buffered turn as one `chat.completion.chunk` event, then `[DONE]`, shaped as the
    rollout framework shapes it (miles/rollout/session/core.py `_response_to_stream_chunk`):
    the first choice only, as index 0, its whole message as one delta (tool calls with their
    `index`, as streamed calls have), its finish reason, then the usage when there is one; no
    `logprobs` and no `meta_info` (the record has them)."""
    document = json.loads(client_body)
    choices = document.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    message = choice.get("message") or {}
    delta: dict[str, Any] = {
        "role": message.get("role", "assistant"),
        "content": message.get("content"),
    }
    if message.get("reasoning_content") is not None:
        delta["reasoning_content"] = message["reasoning_content"]
    if message.get("tool_calls"):
        delta["tool_calls"] = [
            {**call, "index": index} if isinstance(call, dict) else call
            for index, call in enumerate(message["tool_calls"])
        ]
    # The framework's key order, with id / created / model null when the reply lacks them.
    chunk: dict[str, Any] = {
        "id": document.get("id"),
        "object": "chat.completion.chunk",
        "created": document.get("created"),
        "model": document.get("model"),
        "choices": [{"index": 0, "delta": delta, "finish_reason": choice.get("finish_reason")}],
    }
    if document.get("usage") is not None:
        chunk["usage"] = document["usage"]
    try:
        event = json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:
        # A lone surrogate the engine escaped: \u escapes are still valid JSON.
        event = json.dumps(chunk, separators=(",", ":")).encode()
    return b"data: " + event + b"\n\ndata: [DONE]\n\n"


def _wants_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


# Bodies above this are handled in a thread: the Rust primitives release the GIL, so the
# event loop keeps serving other sessions meanwhile; small ones are cheaper inline.
OFF_LOOP_ABOVE = 256 * 1024


async def _off_loop(function: Callable[..., _T], data: bytes, *args: Any) -> _T:
    if len(data) > OFF_LOOP_ABOVE:
        return await asyncio.to_thread(function, data, *args)
    return function(data, *args)


__all__ = ["CoreReply", "CoreRequest", "SessionCore", "UpstreamError", "error_reply", "json_reply"]

"""The session core: HTTP-agnostic handling of every session operation.

Each operation takes a `CoreRequest` (the same fields the IPC request meta carries) and
returns a `CoreReply` (status, headers, body bytes or a stream of chunks), so the in-process
app and the multi-process workers run exactly this code. The core is made of parts, each
given what it depends on: the table and its limits (table.py), the reads (reads.py),
the three-phase turn (turn.py) and the trims of freed memory (freed_memory.py). This module
builds them, holds the one table of operations, and answers the operations that span the
parts (health) or need none of them (the stateless proxy, the engine set).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from sessiongate.engines.hold import HOLD_SETTLE_S
from sessiongate.engines.pool import EnginePool
from sessiongate.errors import BadRequest, GatewayError, LimitReached, UpstreamError
from sessiongate.protocol import (
    CoreReply,
    CoreRequest,
    Op,
    error_reply,
    json_reply,
    parse_json_object,
    upstream_required,
)
from sessiongate.session.freed_memory import FreedMemory
from sessiongate.session.reads import SessionReads
from sessiongate.session.session_table import SessionTable
from sessiongate.session.settings import SessionSettings
from sessiongate.session.state import Session
from sessiongate.session.store.records_store import RecordsStore, RecoveryReport
from sessiongate.session.tito import TitoEngine
from sessiongate.session.turn import SessionTurns
from sessiongate.session_routing.stamper import SessionStamper
from sessiongate.tokenizer import ChatTokenizer

# Proxied replies with a declared length below this are read whole and relayed in one frame.
PROXY_BUFFER_BELOW = 256 * 1024

Operation = Callable[[CoreRequest], Awaitable[CoreReply]]


class SessionCore:
    """Sessions of one worker: a session table, the TITO engine, and one upstream pool."""

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        upstream: EnginePool,
        settings: SessionSettings | None = None,
        stamper: SessionStamper | None = None,
        store: RecordsStore | None = None,
    ) -> None:
        settings = settings or SessionSettings()
        self.upstream = upstream
        self.tito = TitoEngine(
            tokenizer,
            max_trim_tokens=settings.max_trim_tokens,
            chat_template_kwargs=settings.chat_template_kwargs,
            boundary_stop_tokens=settings.boundary_stop_tokens,
            end_of_turn_token=settings.end_of_turn_token,
            comparator=settings.tito_comparator,
        )
        self.memory = FreedMemory.for_settings(settings)
        self.table = SessionTable(settings, upstream, self.memory, stamper=stamper, store=store)
        self.reads = SessionReads(self.table, self.tito)
        self.turns = SessionTurns(self.table, self.tito, self.memory)
        # Operation name -> handler: every operation this core answers, by `CoreRequest.op`.
        self.operations: dict[str, Operation] = {
            Op.HEALTH: self._health,
            Op.CREATE: self.table.create,
            Op.GET: self.reads.get,
            Op.DELETE: self.table.delete,
            Op.CHAT: self.turns.chat,
            Op.MESSAGES: self.turns.messages,
            Op.RESPONSES: self.turns.responses,
            Op.PROXY: self._proxy,
            Op.TRAJECTORY: self.reads.trajectory,
            Op.SAMPLES: self.reads.samples,
            Op.SET_ENGINES: self._set_engines,
        }

    async def handle(self, request: CoreRequest) -> CoreReply:
        self.start()
        if request.op is not Op.HEALTH:  # health checks come on a timer, not with work
            self.memory.active()
        handler = self.operations.get(request.op)
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

    def start(self) -> None:
        """Background work that needs a running loop (idempotent): upstream health probes,
        idle expiry, and the records memory touched at start."""
        self.upstream.start()
        self.table.start()
        self.memory.start()

    def recover(self) -> RecoveryReport | None:
        """Load the records directory's sessions (before serving); None without a store."""
        return self.table.recover()

    async def aclose(self) -> None:
        """Shutdown: end every session (hooks fire once each), then close the upstreams."""
        await self.table.aclose()
        await self.memory.aclose()
        if self.stamper is not None:
            self.stamper.release_all()
        await self.upstream.aclose()
        if self.store is not None:
            await asyncio.to_thread(self.store.close)

    # -- what the workers' heartbeat, /health and /metrics read ---------------------------

    @property
    def settings(self) -> SessionSettings:
        return self.table.settings

    @settings.setter
    def settings(self, settings: SessionSettings) -> None:
        self.table.settings = settings

    @property
    def sessions(self) -> dict[str, Session]:
        return self.table.sessions

    @property
    def stamper(self) -> SessionStamper | None:
        return self.table.stamper

    @property
    def store(self) -> RecordsStore | None:
        return self.table.store

    @property
    def records_bytes(self) -> int:
        return self.table.records_bytes

    @property
    def sessions_expired(self) -> int:
        return self.table.sessions_expired

    @property
    def rejected(self) -> Counter[str]:
        return self.table.rejected

    @property
    def turns_recorded(self) -> int:
        return self.turns.turns_recorded

    @property
    def turns_aborted(self) -> int:
        return self.turns.turns_aborted

    @property
    def rollbacks(self) -> int:
        return self.turns.rollbacks

    @property
    def rollback_steps(self) -> int:
        return self.turns.rollback_steps

    @property
    def r3_missing_turns(self) -> int:
        return self.turns.r3_missing_turns

    @property
    def relay_buffered_turns(self) -> int:
        return self.turns.relay_buffered_turns

    def limits_status(self) -> dict[str, Any]:
        """The limits (0 = off) and their usage, for /health and the worker heartbeat."""
        return self.table.limits_status()

    # -- operations of no single part ---------------------------------------------------

    async def _health(self, request: CoreRequest) -> CoreReply:
        document: dict[str, object] = {
            "status": "ok",
            "sessions": len(self.sessions),
            "turns_recorded": self.turns_recorded,
            "turns_aborted": self.turns_aborted,
            "rollbacks": self.rollbacks,
            "rollback_steps": self.rollback_steps,
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

    async def _set_engines(self, request: CoreRequest) -> CoreReply:
        """The router's engine set (its engine registry's ready engines) for this core's pool. Sent
        on every change and again whenever this worker (re)connects, so a restarted worker
        process, which starts from its --backend argv, converges on the live set."""
        document = parse_json_object(request.body, "the engine set")
        urls = document.get("urls")
        held = document.get("held", [])
        if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
            raise BadRequest('the engine set must be {"urls": [string, ...], "held": [...]}')
        if not isinstance(held, list) or not all(isinstance(u, str) for u in held):
            raise BadRequest('"held" must be a list of engine URLs')
        try:
            self.upstream.set_urls(urls, held)
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        # Answered once the requests picked for a newly held engine are written to it: the
        # router sends the engine its pause only then (engines/hold.py).
        await self.upstream.hold.settle(HOLD_SETTLE_S)
        return json_reply(200, {"urls": self.upstream.urls})

    async def _proxy(self, request: CoreRequest) -> CoreReply:
        root_id = None
        headers = request.headers
        if request.session_id is not None:
            session_id = self.table.session_id(request)
            root_id = self.table.open_session(session_id).root_id
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


__all__ = ["CoreReply", "CoreRequest", "SessionCore", "UpstreamError", "error_reply", "json_reply"]

"""The TITO turn of the session core, in its three phases (docs/architecture.md): plan under
the session lock (turn_plan.py: validate against the history, build the prompt ids), call
the upstream without the lock (turn_call.py builds what is sent), commit under the lock again
unless the session moved on (turn_commit.py). A relayed stream commits at its end.

This module runs the phases in order and owns what spans them: the engine exchange, the
turn's end (whatever happens), and the locking rules, easiest to check in one place.
"""

from __future__ import annotations

import json
import logging
import time
from array import array
from collections.abc import AsyncIterator, Callable
from typing import Any

from sessiongate.dialects import CHAT, Dialect, DialectError, StreamRelay
from sessiongate.dialects.anthropic import ANTHROPIC
from sessiongate.dialects.responses import RESPONSES
from sessiongate.engines.client import EngineReply, EngineStream
from sessiongate.errors import GatewayError, UpstreamError
from sessiongate.protocol import (
    JSON_HEADERS,
    RECORDED_HEADER,
    SSE_HEADERS,
    CoreReply,
    CoreRequest,
    parse_json_object,
)
from sessiongate.session.freed_memory import FreedMemory
from sessiongate.session.messages import resolve_matcher, validate_messages
from sessiongate.session.reply import ParsedReply, parse_reply
from sessiongate.session.request_checks import check_turn_fields
from sessiongate.session.response_history import remember_response, response_items
from sessiongate.session.session_table import SessionTable
from sessiongate.session.stream import (
    DONE,
    ClosingStream,
    SseEvents,
    StreamedTurn,
    error_event,
    sse,
)
from sessiongate.session.tito import TitoEngine
from sessiongate.session.turn_call import (
    off_loop,
    one_chunk_sse,
    turn_headers,
    upstream_body,
    upstream_fields,
    wants_usage,
)
from sessiongate.session.turn_commit import apply_turn, persist_turn, tree_link, turn_record
from sessiongate.session.turn_plan import Turn, TurnRequest, plan_turn

logger = logging.getLogger(__name__)


class SessionTurns:
    """Session turns: plan, call, commit; and the counts of turns /health reports."""

    def __init__(self, table: SessionTable, tito: TitoEngine, memory: FreedMemory) -> None:
        self.table = table
        self.tito = tito
        self.memory = memory
        self.matcher = resolve_matcher(table.settings.message_matcher)
        self.turns_recorded = 0
        self.turns_aborted = 0
        # Line turns that rolled back, and the assistant steps they replaced in all.
        self.rollbacks = 0
        self.rollback_steps = 0
        # Turns recorded without R3 under --r3-missing warn.
        self.r3_missing_turns = 0
        # Streamed turns served buffered under --stream-upstream relay because the engine's
        # stream drops logprobs (/health's relay_buffered_turns).
        self.relay_buffered_turns = 0

    async def chat(self, request: CoreRequest) -> CoreReply:
        """`POST /sessions/{id}/v1/chat/completions` (and header sessions)."""
        return await self.turn(request, CHAT)

    async def messages(self, request: CoreRequest) -> CoreReply:
        """`POST /sessions/{id}/v1/messages`: the Anthropic Messages turn."""
        return await self.turn(request, ANTHROPIC)

    async def responses(self, request: CoreRequest) -> CoreReply:
        """`POST /sessions/{id}/v1/responses`: the OpenAI Responses turn."""
        return await self.turn(request, RESPONSES)

    async def turn(self, request: CoreRequest, dialect: Dialect) -> CoreReply:
        """One TITO turn asked in `dialect`: its body becomes the chat body the turn runs
        on, and the engine's chat reply the dialect's reply (chat: the identity)."""
        request_timestamp = time.time()
        table = self.table
        session_id = table.session_id(request)
        client_body = parse_json_object(request.body, "request body")
        if dialect is CHAT:
            body, chat_bytes = client_body, request.body
        else:
            try:
                body = dialect.to_chat(client_body, self._history(session_id))
            except DialectError as exc:
                reply_body = dialect.error_body(exc.status, exc.message, exc.error_type)
                return CoreReply(exc.status, list(JSON_HEADERS), reply_body)
            # The engine is asked once, whole: a stream is made from its reply.
            body["stream"] = False
            body.pop("stream_options", None)
            chat_bytes = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        check_turn_fields(body)
        asked = TurnRequest(
            session_id=session_id,
            body=body,
            messages=validate_messages(body.get("messages")),
            tools=body.get("tools"),
            template_kwargs=self.tito.resolve_chat_template_kwargs(
                body.get("chat_template_kwargs")
            ),
            headers=request.headers,
            request_timestamp=request_timestamp,
        )
        wants_stream = bool(client_body.get("stream"))
        relay = (
            wants_stream and dialect.relays_streams and table.settings.stream_upstream == "relay"
        )

        session = table.sessions.get(session_id)
        if session is None and not request.auto_create:
            raise table.not_found(session_id)
        if session is None:
            # A session header naming a deleted session: its late turn must not start a new
            # one under the same id.
            gone = table.gone(session_id)
            if gone is not None:
                raise gone
        # Before the session is created and long before the upstream is asked: a refused
        # turn costs the engine nothing and leaves no empty session behind.
        table.check_records_budget()
        if session is None:
            session = table.add_session(session_id, None, from_header=True)

        # Phase 1, under the session lock.
        turn = await plan_turn(
            session,
            asked,
            tito=self.tito,
            settings=table.settings,
            matcher=self.matcher,
            stamper=table.stamper,
        )
        if dialect is not CHAT:
            turn.dialect, turn.client_request = dialect.name, request.body
        # A dialect's relayed stream converts the engine's chunks as they arrive.
        converter = dialect.stream_relay(client_body, len(turn.prompt_ids)) if relay else None
        handed_off = False  # a relayed stream ends the turn itself
        succeeded = False
        try:
            # Phase 2, no lock: the upstream call.
            reply = await self._call(turn, request, body, chat_bytes, relay=relay, events=converter)
            if isinstance(reply, CoreReply):
                handed_off = True
                return reply
            if reply.status != 200:
                # Upstream errors pass through unrecorded (in the dialect's envelope).
                if dialect is CHAT:
                    return CoreReply(reply.status, reply.headers, reply.body)
                error = dialect.engine_error(reply.status, reply.body)
                return CoreReply(reply.status, list(JSON_HEADERS), error)
            parsed = await off_loop(parse_reply, reply.body)
            # Phase 3, under the lock again.
            recorded = await self._commit(turn, reply.body, parsed)
            succeeded = True
        finally:
            if not handed_off:
                await self._end_turn(turn, succeeded)

        extra = [(RECORDED_HEADER, "true" if recorded else "false")]
        if dialect is not CHAT:
            chat_reply = json.loads(parsed.client_body)
            if dialect is RESPONSES and recorded:
                remember_response(session, chat_reply, client_body)
            if wants_stream:
                events = dialect.stream_events(chat_reply, client_body)
                return CoreReply(200, [*SSE_HEADERS, *extra], events)
            return CoreReply(
                200, [*JSON_HEADERS, *extra], dialect.from_chat(chat_reply, client_body)
            )
        if wants_stream:
            # The turn is complete, so its one event goes out as one sized body, as the
            # framework's does (no chunked framing).
            event = await off_loop(one_chunk_sse, parsed.client_body)
            return CoreReply(200, [*SSE_HEADERS, *extra], event)
        return CoreReply(200, [*JSON_HEADERS, *extra], parsed.client_body)

    def _history(self, session_id: str) -> Callable[[str], list[dict[str, Any]]]:
        """The session's earlier responses by id, for `previous_response_id` (KeyError for
        an id the session does not have, or no session)."""

        def lookup(response_id: str) -> list[dict[str, Any]]:
            session = self.table.sessions.get(session_id)
            if session is None:
                raise KeyError(response_id)
            return response_items(session, response_id)

        return lookup

    async def _call(
        self,
        turn: Turn,
        request: CoreRequest,
        body: dict[str, Any],
        chat_bytes: bytes,
        *,
        relay: bool,
        events: StreamRelay | None = None,
    ) -> EngineReply | CoreReply:
        """Ask the engine: its whole reply, or (a relayed turn the engine streams) the
        client's stream, which then owns the turn's end (`events`: a dialect's conversion
        of the chunks; None: chat's chunks go out as they are)."""
        table = self.table
        settings, stamper = table.settings, table.stamper
        upstream = table.upstream
        if relay and not await self._stream_is_exact(turn.session.root_id):
            relay = False
        fields = upstream_fields(turn, settings, relay=relay)
        if relay and events is not None:
            # As SGLang's own dialect streams ask: usage on every chunk, so a dialect's first
            # event can carry the prompt's usage (cached tokens included).
            fields["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        routing_headers = (
            stamper.headers(turn.routing)
            if stamper is not None and turn.routing is not None
            else []
        )
        turn.request_bytes = await upstream_body(chat_bytes, body, fields, turn, stamper)
        headers = turn_headers(turn.session_id, request.headers, routing_headers, settings)
        if not relay:
            return await upstream.post_json(
                turn.session.root_id, settings.chat_path, turn.request_bytes, headers
            )
        stream = await upstream.open_stream(
            turn.session.root_id,
            "POST",
            settings.chat_path,
            headers=[("content-type", "application/json"), *headers],
            body=turn.request_bytes,
        )
        if stream.status == 200 and stream.is_event_stream():
            relayed = ClosingStream(
                self._relay_turn(turn, stream, wants_usage(body), events),
                lambda: self._end_relay(turn, stream),
            )
            return CoreReply(200, SSE_HEADERS, stream=relayed)
        # An error status passes through; a 200 that is not a stream is a whole reply.
        return EngineReply(stream.status, stream.headers, await stream.read_all())

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
        info = await self.table.upstream.model_info(root_id)
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

    def _check_reply(self, parsed: ParsedReply) -> None:
        """Contract checks that depend on this gateway's settings."""
        settings = self.table.settings
        if settings.r3 and parsed.routed_experts is None:
            if settings.r3_missing == "error":
                raise UpstreamError(
                    "upstream reply has no routed_experts although --r3 asked for them (start "
                    "SGLang with --enable-return-routed-experts, or serve with --r3-missing "
                    "warn to record such turns anyway)"
                )
            self.r3_missing_turns += 1
            logger.warning(
                "turn recorded without routed_experts (%d so far)", self.r3_missing_turns
            )

    async def _commit(self, turn: Turn, reply_body: bytes, parsed: ParsedReply) -> bool:
        """Record the turn unless the session moved on; says whether it did."""
        self._check_reply(parsed)
        table = self.table
        store = table.store
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
            record = turn_record(turn, table.settings.chat_path, reply_body, parsed)
            messages = [*turn.messages, parsed.assistant_message]
            link = tree_link(turn, reply_body)
            if store is not None:
                # Written (per --records-durability) before anything changes: a turn the
                # disk refused is not recorded at all.
                await persist_turn(store, turn, record, messages, reply_body, parsed, link)
            table.records_bytes += apply_turn(turn, record, messages, new_ids, link, store)
            self.turns_recorded += 1
            if record.aborted:
                self.turns_aborted += 1
            if record.rollback_steps:
                self.rollbacks += 1
                self.rollback_steps += record.rollback_steps
            if store is not None:
                # Spilled bodies are freed memory like a closed session's: give it back.
                freed = store.resident.enforce()
                if freed:
                    self.memory.freed(freed)
            return True

    async def _end_turn(self, turn: Turn, succeeded: bool) -> None:
        self.memory.active()
        stamper = self.table.stamper
        async with turn.session.lock:
            if stamper is not None:
                stamper.finish_turn(turn.session_id, final=turn.final_turn, succeeded=succeeded)
            turn.session.turn_finished()
            if turn.session.tree is not None:
                turn.session.tree.pending -= 1
            turn.session.last_active = time.monotonic()

    async def _relay_turn(
        self,
        turn: Turn,
        upstream: EngineStream,
        client_wants_usage: bool,
        dialect: StreamRelay | None = None,
    ) -> AsyncIterator[bytes]:
        """The client's SSE stream of a relayed turn; records the turn at its end.

        Events go out as they arrive, except the sglext chunk (R3 and ids are the record's)
        and a usage chunk the client did not ask for. At the upstream's `[DONE]` the turn's
        non-stream reply is rebuilt, checked like any reply and recorded before the client's
        `[DONE]`. A failure after the 200 went out can only be told in the stream: an
        `{"error": ...}` event, and the turn is not recorded. With `dialect` each chunk goes
        out as that dialect's events instead, and its closing events stand for `[DONE]`.
        """
        streamed = StreamedTurn(client_wants_usage=client_wants_usage and dialect is None)
        try:
            events = SseEvents()
            async for piece in upstream.raw_chunks():
                for data in events.feed(piece):
                    relayed = streamed.feed(data)
                    if relayed is None:
                        continue
                    if dialect is None:
                        yield sse(relayed)
                    else:
                        for event in dialect.chunk(streamed.event):
                            yield event
            reply_body = streamed.reply()
            parsed = await off_loop(parse_reply, reply_body)
            recorded = await self._commit(turn, reply_body, parsed)
            turn.succeeded = True  # recorded (or raced): a client gone now changes nothing
            if dialect is None:
                yield sse(DONE)
            else:
                chat_reply = json.loads(parsed.client_body)
                if recorded and turn.dialect == RESPONSES.name:
                    client_body = json.loads(turn.client_request or b"{}")
                    remember_response(turn.session, chat_reply, client_body)
                yield b"".join(dialect.finish(chat_reply))
        except GatewayError as exc:
            yield error_event(str(exc)) if dialect is None else b"".join(dialect.fail(str(exc)))
        finally:
            await self._end_relay(turn, upstream)

    async def _end_relay(self, turn: Turn, upstream: EngineStream) -> None:
        """Ends a relayed turn once, from the relay's own end or from its reply stream's
        `aclose` when the relay never started."""
        if turn.ended:
            return
        turn.ended = True
        await upstream.aclose()
        await self._end_turn(turn, turn.succeeded)

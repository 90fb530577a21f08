"""The TITO turn of the session core, in its three phases (docs/architecture.md): plan under
the session lock (validate against the history, build the prompt ids), call the upstream
without the lock, commit under the lock again unless the session moved on. A relayed stream
commits at its end. Its own module because the phases share state (`_Turn`) no other
operation needs, and the locking rules are easiest to check in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from array import array
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from sessiongate.engines.client import EngineReply, EngineStream
from sessiongate.errors import GatewayError, SessionNotFound, UpstreamError
from sessiongate.http.forwarding import forwardable_headers
from sessiongate.primitives import rewrite_request
from sessiongate.protocol import (
    JSON_HEADERS,
    RECORDED_HEADER,
    SSE_HEADERS,
    CoreReply,
    CoreRequest,
    parse_json_object,
)
from sessiongate.session.messages import HistoryPlan, plan_history, validate_messages
from sessiongate.session.registry import SessionRegistry
from sessiongate.session.reply import ParsedReply, finish_reason_text, parse_reply
from sessiongate.session.request_checks import check_turn_fields
from sessiongate.session.state import Session, TurnRecord
from sessiongate.session.store.records_store import RecordsStore
from sessiongate.session.store.turn_entry import TreeLink, TurnEntry, span_in
from sessiongate.session.stream import (
    DONE,
    ClosingStream,
    SseEvents,
    StreamedTurn,
    error_event,
    sse,
)
from sessiongate.session.tree import TreeNode, TreePlan, leading_id

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


class SessionTurns(SessionRegistry):
    """Session turns: plan, call, commit."""

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
                reply = EngineReply(upstream.status, upstream.headers, await upstream.read_all())
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
        self, turn: _Turn, upstream: EngineStream, client_wants_usage: bool
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

    async def _end_relay(self, turn: _Turn, upstream: EngineStream) -> None:
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

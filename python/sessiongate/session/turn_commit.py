"""Phase 3 of a TITO turn (docs/architecture.md), under the session lock again: the engine's
reply becomes the turn's record, written to the records directory first (when there is one),
then applied to the session: a new node of a tree, or the line's next (or replaced)
checkpoint.

Its own module so that everything a commit changes in a session is in one place; whether to
commit at all (the session moved on, or closed) is decided by the caller, `SessionTurns`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from array import array
from typing import Any

from sessiongate.session.reply import ParsedReply, finish_reason_text
from sessiongate.session.state import Session, TurnRecord
from sessiongate.session.store.records_store import RecordsStore
from sessiongate.session.store.turn_entry import TreeLink, TurnEntry, span_in
from sessiongate.session.tree import leading_id
from sessiongate.session.turn_plan import Turn


def turn_record(turn: Turn, chat_path: str, reply_body: bytes, parsed: ParsedReply) -> TurnRecord:
    """The record of a turn the engine answered with `reply_body`."""
    return TurnRecord(
        timestamp=time.time(),
        method="POST",
        path=chat_path,
        status_code=200,
        request=turn.request_bytes,
        response=reply_body,
        prompt_len=len(turn.prompt_ids),
        completion_ids=array("i", parsed.completion_ids),
        logprobs=array("d", parsed.logprobs),
        finish_reason=finish_reason_text(parsed.finish_reason),
        routed_experts=parsed.routed_experts,
        r3_start_row=turn.r3_start_row,
        indexer_topk=parsed.indexer_topk,
        weight_version=parsed.weight_version,
        cached_tokens=parsed.cached_tokens,
        e2e_latency=parsed.e2e_latency,
        request_timestamp=turn.request_timestamp,
        rollback_steps=turn.rollback_steps,
        dialect=turn.dialect,
        client_request=turn.client_request,
    )


def tree_link(turn: Turn, reply_body: bytes) -> TreeLink | None:
    """Where a tree turn's node goes (None for a line session)."""
    tree = turn.session.tree
    if tree is None:
        return None
    parent = turn.tree_parent.id if turn.tree_parent is not None else None
    return TreeLink(len(tree.nodes), parent, leading_id(reply_body))


def apply_turn(
    turn: Turn,
    record: TurnRecord,
    messages: list[Any],
    new_ids: array[int],
    link: TreeLink | None,
    store: RecordsStore | None,
) -> int:
    """Apply a recorded turn to its session; returns the change of its records' bytes."""
    session = turn.session
    if session.tree is not None and link is not None:
        session.tree.add(
            turn.tree_parent,
            delta_messages=messages[turn.base_len :],
            segment=array("q", new_ids[len(turn.base_ids) :]),
            prompt_len=len(turn.prompt_ids),
            finish_reason=record.finish_reason,
            response_id=link.response_id,
            committed_at=record.timestamp,
            tools=turn.tools,
            template_kwargs=turn.template_kwargs,
        )
        # Node i's record is records[i]: appended, never replaced.
        session.records.append(record)
        change = record.size
    else:
        change = _apply_to_line(session, turn.checkpoint_count, record, messages, new_ids, store)
    session.records_bytes += change
    session.tools = turn.tools
    session.template_kwargs = turn.template_kwargs
    session.version += 1
    return change


def _apply_to_line(
    session: Session,
    kept: int,
    record: TurnRecord,
    messages: list[Any],
    new_ids: array[int],
    store: RecordsStore | None,
) -> int:
    session.messages = messages
    session.commit_checkpoint(kept, new_ids)
    session.checkpoint_ends = [*session.checkpoint_ends[:kept], len(messages)]
    # A rollback replaces the records past the kept checkpoints: they stop counting.
    dropped = sum(r.size for r in session.records[kept:])
    if store is not None:
        store.resident.drop(session.records[kept:])
    session.records = [*session.records[:kept], record]
    return record.size - dropped


async def persist_turn(
    store: RecordsStore,
    turn: Turn,
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

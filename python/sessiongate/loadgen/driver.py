"""Run one session family against a target, recording every request.

A session sends its turns in order with the full history (its own non-assistant messages
from the spec, the target's assistant replies). Children start after the reply of the turn
that spawns them and run concurrently with their parent; when that turn says
`wait_children`, the parent's next turn waits for them (and their descendants). A session
always waits for all its children before it closes (records GET, DELETE), so a parent is
never deleted under a live child. A failed request ends its session: remaining turns and
children are skipped, the session still closes, and the failure is counted.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from sessiongate.loadgen.http import Exchange
from sessiongate.loadgen.stats import Collector
from sessiongate.loadgen.targets import SessionHandle, Target
from sessiongate.loadgen.workload import SessionSpec


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """Request fields every chat turn carries (the spec's per-turn `body` may add more)."""

    model: str
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    r3: bool = False
    ignore_eos: bool = False
    stream_usage: bool = False  # OpenAI `stream_options.include_usage` (plain endpoints)


def request_body(
    o: RequestOptions, history: list[dict[str, Any]], max_tokens: int, extra: dict[str, Any]
) -> dict[str, Any]:
    """One chat request: the history and the run's fields, then the turn's own."""
    body: dict[str, Any] = {
        "model": o.model,
        "messages": list(history),
        "max_tokens": max_tokens,
    }
    if o.stream:
        body["stream"] = True
        if o.stream_usage:
            body["stream_options"] = {"include_usage": True}
    if o.tools:
        body["tools"] = o.tools
    if o.r3:
        body["return_routed_experts"] = True
    if o.ignore_eos:
        body["ignore_eos"] = True
    if extra:
        body.update(extra)
    return body


def with_tool_ids(
    messages: list[dict[str, Any]], history: list[dict[str, Any]], turn: int
) -> list[dict[str, Any]]:
    """Give tool messages that lack one a `tool_call_id` (strict OpenAI servers require it).

    It is the id of the last assistant message's first tool call when there is one, else a
    stable synthetic `call_<turn>_<index>` (the same on every resend of the history, so the
    gateway's append-only check sees an unchanged prefix).
    """
    last = history[-1] if history else None
    calls = last.get("tool_calls") if last and last.get("role") == "assistant" else None
    call_id = calls[0].get("id") if calls and isinstance(calls[0], dict) else None
    out = []
    for index, message in enumerate(messages):
        if message.get("role") == "tool" and "tool_call_id" not in message:
            message = {**message, "tool_call_id": call_id or f"call_{turn}_{index}"}
        out.append(message)
    return out


class Driver:
    def __init__(self, target: Target, collector: Collector, options: RequestOptions) -> None:
        self.target = target
        self.collector = collector
        self.options = options

    async def run_tree(self, root: SessionSpec, warmup: bool = False) -> None:
        await self._session(root, None, warmup)
        self.collector.trees_done += 1

    def _body(
        self, history: list[dict[str, Any]], max_tokens: int, extra: dict[str, Any]
    ) -> dict[str, Any]:
        return request_body(self.options, history, max_tokens, extra)

    def _record(
        self,
        ex: Exchange,
        handle: SessionHandle | None,
        spec: SessionSpec,
        parent: SessionHandle | None,
        warmup: bool,
        turn: int | None = None,
        final: bool = False,
    ) -> None:
        ids = (
            (handle.session_id, handle.parent_id, handle.root_id)
            if handle is not None
            else (None, parent.session_id if parent else None, parent.root_id if parent else None)
        )
        self.collector.add(ex, session=ids, trace_id=spec.id, turn=turn, final=final, warmup=warmup)

    async def _session(self, spec: SessionSpec, parent: SessionHandle | None, warmup: bool) -> bool:
        c = self.collector
        c.sessions_started += 1
        handle, created = await self.target.open(parent)
        if created is not None:
            self._record(created, handle, spec, parent, warmup)
        if handle is None:
            c.sessions_done += 1
            c.sessions_failed += 1
            return False
        ok = True
        history: list[dict[str, Any]] = []
        waiting: list[asyncio.Task[bool]] = []
        children: list[asyncio.Task[bool]] = []
        try:
            last = len(spec.turns) - 1
            for t, turn in enumerate(spec.turns):
                if waiting:
                    await asyncio.gather(*waiting)
                    waiting = []
                if t and turn.delay_s > 0:
                    await asyncio.sleep(turn.delay_s)
                history.extend(with_tool_ids(turn.messages, history, t))
                body = self._body(history, turn.max_tokens, turn.body)
                ex = await self.target.turn(
                    handle, body, final=t == last, spawns=len(turn.children)
                )
                self._record(ex, handle, spec, parent, warmup, turn=t, final=t == last)
                if not ex.ok or ex.message is None:
                    ok = False
                    break
                history.append(ex.message)
                spawned = [
                    asyncio.create_task(self._session(child, handle, warmup))
                    for child in turn.children
                ]
                children += spawned
                if turn.wait_children:
                    waiting = spawned
            if children:
                await asyncio.gather(*children)
            closing = await self.target.close(handle)
        except asyncio.CancelledError:
            for task in children:
                task.cancel()
            await asyncio.gather(*children, return_exceptions=True)
            self.target.abandon(handle)
            raise
        for ex in closing:
            self._record(ex, handle, spec, parent, warmup)
            ok = ok and ex.ok
        c.sessions_done += 1
        if not ok:
            c.sessions_failed += 1
        return ok

"""Run one tree session (retries, forks, a resume) and check the tree the gateway built.

Branches send the full history like linear sessions. The main line starts each fork once
the reply it forks from is in; forks run concurrently with the rest of the main line; the
resume starts when every other branch is done. A retried turn is sent, its reply
abandoned, and the identical body sent again. A reply cut at `max_tokens` (finish reason
`length`) ends its branch there, and no fork or resume starts from it: the gateway refuses
to extend a truncated path (409), as an agent would learn. A failed turn ends the session
(branches stop before their next turn), which still closes.

Closing: `GET /sessions/{id}` (unless --no-records), `POST /sessions/{id}/samples`, the tree
check (`tree_check.py`), DELETE. A check that finds problems marks the samples request
failed with error key `tree_mismatch`, so it counts like any other error.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sessiongate.loadgen.driver import RequestOptions, request_body, with_tool_ids
from sessiongate.loadgen.http import ERROR_TEXT_LIMIT, Exchange
from sessiongate.loadgen.stats import Collector
from sessiongate.loadgen.targets import SessiongateTarget, SessionHandle
from sessiongate.loadgen.tree_check import SamplesPayload, TreeResult, check_tree, parse_samples
from sessiongate.loadgen.tree_log import LoggedNode, TreeLog, completion_ids_of
from sessiongate.loadgen.tree_workload import BranchSpec, TreeSessionSpec

TREE_MISMATCH = "tree_mismatch"


@dataclass(slots=True)
class TreeSession:
    """Everything a tree hook (the demo's verifier) gets about one closed session."""

    handle: SessionHandle
    spec: TreeSessionSpec
    log: TreeLog
    records: dict[str, Any] | None  # the GET body (the active path), when it was fetched
    samples: SamplesPayload | None
    result: TreeResult


TreeHook = Callable[[TreeSession], None]


@dataclass(slots=True)
class _Run:
    """One session's state while its branches run."""

    spec: TreeSessionSpec
    handle: SessionHandle
    warmup: bool
    log: TreeLog = field(default_factory=TreeLog)
    failed: bool = False
    # Main-line turn index -> (kept node, history through its reply): forks and the resume
    # start from these.
    kept: dict[int, tuple[LoggedNode, list[dict[str, Any]]]] = field(default_factory=dict)
    forks: list[asyncio.Task[None]] = field(default_factory=list)


class TreeDriver:
    def __init__(
        self,
        target: SessiongateTarget,
        collector: Collector,
        options: RequestOptions,
        *,
        picker: str = "drop_retries",
        hook: TreeHook | None = None,
    ) -> None:
        self.target = target
        self.collector = collector
        self.options = options
        self.picker = picker
        self.hook = hook

    async def run_tree(self, spec: TreeSessionSpec, warmup: bool = False) -> None:
        await self._session(spec, warmup)
        self.collector.trees_done += 1

    def _record(self, run: _Run, ex: Exchange, trace_id: str | None = None, **kw: Any) -> None:
        h = run.handle
        self.collector.add(
            ex,
            session=(h.session_id, None, h.root_id),
            trace_id=trace_id or run.spec.id,
            warmup=run.warmup,
            **kw,
        )

    async def _session(self, spec: TreeSessionSpec, warmup: bool) -> None:
        c = self.collector
        c.sessions_started += 1
        handle, created = await self.target.open(None)
        if handle is None:
            if created is not None:
                c.add(created, session=(None, None, None), trace_id=spec.id, warmup=warmup)
            c.sessions_done += 1
            c.sessions_failed += 1
            return
        run = _Run(spec, handle, warmup)
        if created is not None:
            self._record(run, created)
        try:
            await self._branch(run, spec.main, [], None)
            if run.forks:
                await asyncio.gather(*run.forks)
            await self._resume(run)
            ok = await self._close(run)
        except asyncio.CancelledError:
            for task in run.forks:
                task.cancel()
            await asyncio.gather(*run.forks, return_exceptions=True)
            self.target.abandon(handle)
            raise
        c.sessions_done += 1
        if run.failed or not ok:
            c.sessions_failed += 1

    def _final_branch(self, run: _Run, branch: BranchSpec) -> bool:
        # The last branch sent in sequence; forks may outlive the main line, but which one
        # ends last is known only afterwards.
        return branch is (run.spec.resume or run.spec.main)

    async def _branch(
        self,
        run: _Run,
        branch: BranchSpec,
        history: list[dict[str, Any]],
        parent: int | None,
    ) -> None:
        log = run.log
        trace_id = run.spec.id if branch.after is None else f"{run.spec.id}/{branch.label}"
        last = len(branch.turns) - 1
        for i, turn in enumerate(branch.turns):
            if run.failed:
                return
            if (i or branch.after is not None) and turn.delay_s > 0:
                await asyncio.sleep(turn.delay_s)
            depth = branch.depth(i)
            messages = [*history, *with_tool_ids(turn.messages, history, depth)]
            body = request_body(self.options, messages, turn.max_tokens, turn.body)
            final = i == last and self._final_branch(run, branch)
            attempts = 1 + branch.retries[i]
            node: LoggedNode | None = None
            for attempt in range(attempts):
                if attempt:
                    log.retries += 1
                ex = await self.target.turn(run.handle, body, final=final, spawns=0)
                self._record(run, ex, trace_id, turn=depth, final=final)
                if not ex.ok or ex.message is None:
                    run.failed = True
                    return
                node = log.add(
                    parent=parent,
                    branch=branch.label,
                    depth=depth,
                    response_id=ex.response_id,
                    finish_reason=ex.finish_reason,
                    messages=messages,
                    reply=ex.message,
                    abandoned=attempt < attempts - 1,
                    completion_ids=completion_ids_of(ex.document) if self.hook else None,
                )
            assert node is not None
            history = [*messages, node.reply]
            parent = node.key
            if branch.after is None:
                self._main_turn_done(run, i, node, history)
            if node.finish_reason == "length" and i < last:
                log.cut += 1  # a truncated path cannot be extended (the gateway's 409)
                return

    def _main_turn_done(
        self, run: _Run, index: int, node: LoggedNode, history: list[dict[str, Any]]
    ) -> None:
        run.kept[index] = (node, history)
        for fork in run.spec.forks:
            if fork.after != index:
                continue
            if node.finish_reason == "length":
                run.log.cut += 1
                continue
            run.log.forks += 1
            run.forks.append(asyncio.create_task(self._branch(run, fork, history, node.key)))

    async def _resume(self, run: _Run) -> None:
        resume = run.spec.resume
        after = None if resume is None else resume.after
        if resume is None or after is None or run.failed or after not in run.kept:
            return  # no resume, or the main line ended (failed, cut) before its turn
        node, history = run.kept[after]
        if node.finish_reason == "length":
            run.log.cut += 1
            return
        run.log.resumes += 1
        await self._branch(run, resume, history, node.key)

    async def _close(self, run: _Run) -> bool:
        """Fetch, check, delete; False when a request failed or the tree does not match."""
        target, handle = self.target, run.handle
        done: list[Exchange] = []
        records: dict[str, Any] | None = None
        if target.records:
            get, body = await target.get_records(handle, keep=self.hook is not None)
            done.append(get)
            if get.ok and body:
                records = _json(body)
        samples_ex, body = await target.samples(handle)
        payload: SamplesPayload | None = None
        result = TreeResult(
            retries=run.log.retries, forks=run.log.forks, resumes=run.log.resumes, cut=run.log.cut
        )
        if samples_ex.ok:
            try:
                payload = parse_samples(body)
            except ValueError as exc:
                samples_ex.error_key, samples_ex.error = "invalid", str(exc)[:ERROR_TEXT_LIMIT]
        if payload is not None:
            result = check_tree(run.log, payload, self.picker)
            if result.problems:
                samples_ex.error_key = TREE_MISMATCH
                samples_ex.error = "; ".join(result.problems)[:ERROR_TEXT_LIMIT]
        done.append(samples_ex)
        if self.hook is not None:
            self.hook(TreeSession(handle, run.spec, run.log, records, payload, result))
        if not run.warmup and self.collector.tree is not None:
            self.collector.tree.add(handle.session_id, result)
        done.append(await target.delete(handle))
        for ex in done:
            self._record(run, ex)
        return all(ex.ok for ex in done)


def _json(body: bytes) -> dict[str, Any] | None:
    try:
        document = json.loads(body)
    except ValueError:
        return None
    return document if isinstance(document, dict) else None

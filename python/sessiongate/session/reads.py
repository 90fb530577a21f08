"""Read operations of the session core: a session's records (GET), its trajectory file and
its trainer samples. Each works on a consistent snapshot taken under the session
lock and does the heavy assembly off the event loop, so reads never block turns for long.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

from sessiongate.errors import BadRequest, GatewayError
from sessiongate.protocol import JSON_HEADERS, CoreReply, CoreRequest, parse_json_object
from sessiongate.session.samples import build_samples_payload
from sessiongate.session.session_table import SessionTable
from sessiongate.session.state import Session, TurnRecord
from sessiongate.session.store.spilled import SpilledRecord, pin_files
from sessiongate.session.tito import TitoEngine
from sessiongate.session.trajectory import build_trajectory, weight_versions
from sessiongate.session.tree_export import (
    TreeSnapshot,
    tree_samples_payload,
    tree_trajectory_parts,
)
from sessiongate.session.tree_hooks import load_hook

# Session dumps at least this large are streamed in parts instead of joined.
STREAM_GET_ABOVE = 1024 * 1024


class SessionReads:
    """What reads a session without changing it."""

    def __init__(self, table: SessionTable, tito: TitoEngine) -> None:
        self.table = table
        self.tito = tito
        settings = table.settings
        # Tree sessions' sample selection (loaded in any mode: recovered sessions may be
        # trees); a bad hook fails the core's construction, before it serves anything.
        self.pick_hook = load_hook("pick", settings.tree_pick_hook)
        self.postprocess_hook = load_hook("postprocess", settings.tree_postprocess_hook)

    async def _snapshot(
        self, request: CoreRequest
    ) -> tuple[Session, list[TurnRecord], list[int], dict[str, Any], TreeSnapshot | None]:
        """A consistent copy of a session's records and ids, with the TITO metadata that a
        fresh render of its history gives (computed off the event loop). A tree session's
        records and ids are its active path's (ending at the latest committed node), and the
        whole tree comes too (`metadata.tree`, and the snapshot)."""
        session = self.table.open_session(self.table.session_id(request))
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
        detail: list[dict[str, Any]] | None = None
        if accumulated:
            try:
                report, detail = await asyncio.to_thread(
                    functools.partial(self.tito.mismatch_report, template_kwargs=template_kwargs),
                    messages,
                    tools,
                    accumulated,
                )
                metadata["tito_session_mismatch"] = report
            except (GatewayError, ValueError) as exc:
                metadata["tito_session_mismatch_error"] = str(exc)
        if tree is not None:
            metadata["tree"] = tree.table
        if detail is not None:  # after the framework's keys: sessiongate's own
            metadata["tito_session_mismatch_detail"] = detail
        return session, records, accumulated, metadata, tree

    async def get(self, request: CoreRequest) -> CoreReply:
        session, records, accumulated, tito, _ = await self._snapshot(request)
        metadata: dict[str, Any] = {
            "accumulated_token_ids": accumulated,
            **tito,
            "parent_session_id": session.parent_id,
            "child_session_ids": list(session.children),
            "num_turns": len(records),
            # The versions that sampled the turns, in order of first use: more than one when
            # a weight update landed mid-session (docs/trajectory.md).
            "weight_versions": weight_versions(records),
        }
        head = json.dumps({"session_id": session.session_id}, separators=(",", ":")).encode()
        meta = json.dumps(metadata, ensure_ascii=False, separators=(",", ":")).encode()
        parts = _session_document_parts(head[:-1], records, meta)
        if sum(r.size for r in records) < STREAM_GET_ABOVE:
            return CoreReply(200, list(JSON_HEADERS), b"".join([p async for p in parts]))
        # Large sessions go out record by record: never one buffer the size of the dump.
        return CoreReply(200, list(JSON_HEADERS), stream=parts, coalesce=True)

    async def trajectory(self, request: CoreRequest) -> CoreReply:
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
                r3_topk=self.table.settings.r3_topk,
            )
        else:
            parts = await asyncio.to_thread(
                build_trajectory,
                session.session_id,
                records,
                accumulated,
                metadata,
                r3_topk=self.table.settings.r3_topk,
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

    async def samples(self, request: CoreRequest) -> CoreReply:
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
                    r3_topk=self.table.settings.r3_topk,
                    indexer_topk=self.table.settings.indexer_topk,
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
            r3_topk=self.table.settings.r3_topk,
            indexer_topk=self.table.settings.indexer_topk,
        )
        return CoreReply(200, [("content-type", "application/octet-stream")], payload)


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

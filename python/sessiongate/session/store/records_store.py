"""The records store of one worker: one append-only file per session under DIR/sessions,
written by one writer thread (so a session's entries land in commit order), acknowledged
per `--records-durability`, read back on restart, and the RAM budget of record bytes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import json
import logging
import os
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from sessiongate.errors import StoreWriteFailed
from sessiongate.session.state import Session, TurnRecord
from sessiongate.session.store.entry_file import (
    HEADER,
    KIND_OPEN,
    KIND_TURN,
    Buffer,
    entry_header,
    read_exact,
    scan,
    write_all,
)
from sessiongate.session.store.spilled import BodyLocation, SpilledRecord, spill
from sessiongate.session.store.turn_entry import (
    OpenEntry,
    TurnEntry,
    blob_offsets,
    decode_open,
    decode_turn,
    decode_turn_head,
    encode_open,
    encode_turn,
    head_bytes_needed,
)
from sessiongate.session.tree import MAX_NODES, SessionTree

logger = logging.getLogger(__name__)

Durability = Literal["none", "flush", "fsync"]
# DURABILITIES (config/records.py) lists the same three words, for the command line.
FORMAT = 1
MANIFEST = "store.json"
# Deleted session ids and when, one "<id> <unix time>" line each (session/reclaimed.py).
RECLAIMED = "reclaimed"


def session_file_name(session_id: str) -> str:
    """Ids are any visible ASCII up to 256 characters: hashed into a safe file name."""
    return hashlib.blake2b(session_id.encode(), digest_size=16).hexdigest() + ".rec"


@dataclass(frozen=True)
class StoreSettings:
    directory: Path
    durability: Durability = "flush"
    memory_budget: int = 0  # record bytes kept in RAM; older ones are read from their files
    shard: str | None = None  # "I/N" of a supervised worker: a restart must match it


@dataclass
class RecoveryReport:
    sessions: int = 0
    turns: int = 0
    bytes: int = 0
    torn_tails: int = 0
    dropped_files: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "sessions": self.sessions,
            "turns": self.turns,
            "bytes": self.bytes,
            "torn_tails": self.torn_tails,
            "dropped_files": self.dropped_files,
            "seconds": round(self.seconds, 3),
        }


class RecordsStore:
    def __init__(self, settings: StoreSettings) -> None:
        self.settings = settings
        self.sessions_dir = settings.directory / "sessions"
        self._writer = concurrent.futures.ThreadPoolExecutor(1, "records-writer")
        self.resident = ResidentRecords(settings.memory_budget)
        self.write_errors = 0
        self.bytes_written = 0
        self.recovery = RecoveryReport()
        self._prepare()

    # -- layout --------------------------------------------------------------------------

    def _prepare(self) -> None:
        try:
            self._check_manifest()
        except OSError as exc:  # not a directory, unwritable
            raise SystemExit(f"--records-dir {self.settings.directory}: {exc}") from None

    def _check_manifest(self) -> None:
        self.sessions_dir.mkdir(parents=True, exist_ok=True)
        manifest = self.settings.directory / MANIFEST
        wanted = {"format": FORMAT, "shard": self.settings.shard}
        if manifest.exists():
            try:
                found = json.loads(manifest.read_text())
            except ValueError as exc:
                raise SystemExit(f"--records-dir: {manifest} is not JSON: {exc}") from None
            if not isinstance(found, dict) or found.get("format") != FORMAT:
                raise SystemExit(
                    f"--records-dir {self.settings.directory}: {MANIFEST} is not a store of "
                    f"format {FORMAT} (found {str(found)[:80]!r})"
                )
            if self.settings.shard and found.get("shard") not in (None, self.settings.shard):
                raise SystemExit(
                    f"--records-dir {self.settings.directory} holds shard {found['shard']} of "
                    f"an earlier run, this worker is shard {self.settings.shard}: sessions "
                    "are placed by the worker count, so restart with the same --workers"
                )
        manifest.write_text(json.dumps(wanted) + "\n")

    def path_of(self, session_id: str) -> Path:
        return self.sessions_dir / session_file_name(session_id)

    # -- writes (one writer thread: per-session order is commit order) --------------------

    def append_open(self, session: Session) -> concurrent.futures.Future[int]:
        payload = encode_open(
            OpenEntry(
                session_id=session.session_id,
                parent_id=session.parent_id,
                root_id=session.root_id,
                created_at=session.created_at,
                from_header=session.from_header,
                mode="tree" if session.tree is not None else "linear",
            )
        )
        return self._writer.submit(self._append, session.session_id, KIND_OPEN, [payload], True)

    def append_turn(
        self, session_id: str, entry: TurnEntry
    ) -> tuple[concurrent.futures.Future[int], Callable[[int], BodyLocation]]:
        """Queue the turn's entry; returns the write (resolving to the payload's offset)
        and how to turn that offset into where the record's bodies are."""
        parts = encode_turn(entry)
        request_at, response_at = blob_offsets(parts)
        path = str(self.path_of(session_id))
        record = entry.record

        def location(payload_offset: int) -> BodyLocation:
            return BodyLocation(
                path=path,
                request_offset=payload_offset + request_at,
                request_len=len(record.request),
                response_offset=payload_offset + response_at,
                response_len=len(record.response),
                routed_span=entry.routed_span,
                indexer_span=entry.indexer_span,
            )

        future = self._writer.submit(self._append, session_id, KIND_TURN, parts, False)
        return future, location

    def remove(self, session_id: str) -> concurrent.futures.Future[None]:
        return self._writer.submit(self._remove, session_id)

    # -- reclaimed ids (session/reclaimed.py) ---------------------------------------------

    @property
    def reclaimed_path(self) -> Path:
        return self.settings.directory / RECLAIMED

    def append_reclaimed(self, session_id: str, when: float) -> concurrent.futures.Future[None]:
        """Queue a deleted session's tombstone line (after its file's removal: same writer)."""
        return self._writer.submit(self._append_reclaimed, f"{session_id} {when!r}\n")

    def _append_reclaimed(self, line: str) -> None:
        with open(self.reclaimed_path, "a", encoding="ascii") as file:
            file.write(line)

    def read_reclaimed(self) -> list[tuple[str, float]]:
        """The tombstones written before, oldest first; unreadable lines are skipped (a
        line cut off by a crash)."""
        try:
            text = self.reclaimed_path.read_text(encoding="ascii", errors="replace")
        except FileNotFoundError:
            return []
        entries: list[tuple[str, float]] = []
        for line in text.splitlines():
            parts = line.split(" ")
            if len(parts) != 2:
                continue
            try:
                entries.append((parts[0], float(parts[1])))
            except ValueError:
                continue
        return entries

    def rewrite_reclaimed(self, entries: list[tuple[str, float]]) -> None:
        """Compact the file to `entries` (at recovery, before any writer task runs)."""
        temporary = self.reclaimed_path.with_suffix(".tmp")
        temporary.write_text("".join(f"{i} {w!r}\n" for i, w in entries), encoding="ascii")
        os.replace(temporary, self.reclaimed_path)

    async def settle(self, future: concurrent.futures.Future[Any]) -> Any:
        """Wait for a write as the durability setting says (none: do not wait)."""
        if self.settings.durability == "none":
            future.add_done_callback(self._log_failure)
            return None
        try:
            return await asyncio.wrap_future(future)
        except OSError as exc:
            raise StoreWriteFailed(
                f"records directory write failed ({exc}); the turn was not recorded"
            ) from exc

    def _log_failure(self, future: concurrent.futures.Future[Any]) -> None:
        exc = future.exception()
        if exc is not None:
            logger.error("records directory write failed (--records-durability none): %s", exc)

    def _append(self, session_id: str, kind: int, parts: Sequence[Buffer], create: bool) -> int:
        path = self.path_of(session_id)
        flags = os.O_WRONLY | os.O_APPEND | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(path, flags, 0o600)
        except OSError:
            self.write_errors += 1
            raise
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            written = write_all(fd, [entry_header(kind, parts), *parts])
            if self.settings.durability == "fsync":
                os.fdatasync(fd)
        except OSError:
            self.write_errors += 1
            # Cut a partial entry off at once: later entries must not follow a torn one
            # (recovery stops at the first bad entry).
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
            raise
        finally:
            os.close(fd)
        offset = start + HEADER.size
        if create and self.settings.durability == "fsync":
            _fsync_dir(self.sessions_dir)  # the new file's name survives a host crash too
        self.bytes_written += written
        return offset

    def _remove(self, session_id: str) -> None:
        try:
            self.path_of(session_id).unlink()
        except FileNotFoundError:
            pass
        if self.settings.durability == "fsync":
            _fsync_dir(self.sessions_dir)

    def close(self) -> None:
        self._writer.shutdown(wait=True)

    # -- recovery ------------------------------------------------------------------------

    def recover(self) -> list[Session]:
        """Every session of the directory as it was last committed, records on disk. Torn
        tails are cut off; a file that is not a session (no whole OPEN entry) is removed."""
        started = time.monotonic()
        report = RecoveryReport()
        sessions: list[Session] = []
        for path in sorted(self.sessions_dir.glob("*.rec")):
            session = self._recover_file(path, report)
            if session is not None:
                sessions.append(session)
        by_id = {s.session_id: s for s in sessions}
        for session in sorted(sessions, key=lambda s: s.created_at):
            parent = by_id.get(session.parent_id) if session.parent_id else None
            if parent is not None:
                parent.children.append(session.session_id)
        report.sessions = len(sessions)
        report.seconds = time.monotonic() - started
        self.recovery = report
        return sessions

    def _recover_file(self, path: Path, report: RecoveryReport) -> Session | None:
        fd = os.open(path, os.O_RDWR)
        try:
            found = scan(fd)
            if found.torn:
                report.torn_tails += 1
                logger.warning(
                    "%s: %s; dropping the last %d bytes (a write cut off by a crash)",
                    path,
                    found.problem,
                    found.size - found.valid_end,
                )
                os.ftruncate(fd, found.valid_end)
            entries = found.entries
            if not entries or entries[0].kind != KIND_OPEN:
                report.dropped_files.append(path.name)
                os.close(fd)
                fd = -1
                path.unlink()
                return None
            opened = decode_open(read_exact(fd, entries[0].offset, entries[0].length))
            session = Session(
                session_id=opened.session_id,
                parent_id=opened.parent_id,
                root_id=opened.root_id,
                created_at=opened.created_at,
                from_header=opened.from_header,
                tree=SessionTree() if opened.mode == "tree" else None,
            )
            valid_end = found.valid_end
            for entry in entries[1:]:
                turn = _read_turn(fd, entry.offset, entry.length)
                if session.tree is not None and not _links_into(session.tree, turn):
                    # Only an entry whose parent's write failed under --records-durability
                    # none can get here. What follows cannot be placed either: cut it off,
                    # like a torn tail, so later appends are not stranded behind it.
                    valid_end = entry.offset - HEADER.size
                    logger.warning(
                        "%s: tree turn %s does not follow the %d recovered nodes of session "
                        "%s; dropping it and the %d bytes after it",
                        path,
                        turn.tree,
                        len(session.tree.nodes),
                        session.session_id,
                        found.valid_end - valid_end,
                    )
                    os.ftruncate(fd, valid_end)
                    report.torn_tails += 1
                    break
                location = BodyLocation(
                    path=str(path),
                    request_offset=entry.offset + turn.request_offset,
                    request_len=turn.response_offset - turn.request_offset,
                    response_offset=entry.offset + turn.response_offset,
                    response_len=entry.length - turn.response_offset,
                    routed_span=turn.routed_span,
                    indexer_span=turn.indexer_span,
                )
                replay_turn(session, turn, spill(turn.record, location))
                report.turns += 1
            report.bytes += valid_end
            return session
        finally:
            if fd >= 0:
                os.close(fd)


def _read_turn(fd: int, offset: int, length: int) -> TurnEntry:
    prefix = read_exact(fd, offset, min(length, 4))
    head_len = head_bytes_needed(prefix)
    head, blobs_start = decode_turn_head(read_exact(fd, offset, head_len))
    arrays_len = sum(int(n) for n in head["lengths"][:3])
    arrays = read_exact(fd, offset + blobs_start, arrays_len)
    return decode_turn(head, blobs_start, arrays, b"", b"")


def _links_into(tree: SessionTree, turn: TurnEntry) -> bool:
    link = turn.tree
    return (
        link is not None
        and link.node_id == len(tree.nodes)
        and (link.parent is None or 0 <= link.parent < len(tree.nodes))
        and len(tree.nodes) < MAX_NODES
    )


def replay_turn(session: Session, turn: TurnEntry, record: TurnRecord) -> None:
    """Apply one committed turn to a session, as its commit did (session/turn_commit.py)."""
    if session.tree is not None and turn.tree is not None:
        replay_tree_turn(session, session.tree, turn, record)
        return
    kept = turn.kept
    base = session.checkpoint(kept) if kept else ()
    new_ids = [*base, *turn.prompt_tail, *record.completion_ids]
    session.messages = [*session.messages[: turn.base_len], *turn.messages]
    session.commit_checkpoint(kept, new_ids)
    session.checkpoint_ends = [*session.checkpoint_ends[:kept], len(session.messages)]
    dropped = sum(r.size for r in session.records[kept:])  # a rollback's replaced records
    session.records = [*session.records[:kept], record]
    session.records_bytes += record.size - dropped
    session.tools = turn.tools
    session.template_kwargs = turn.template_kwargs
    session.version += 1


def replay_tree_turn(
    session: Session, tree: SessionTree, turn: TurnEntry, record: TurnRecord
) -> None:
    """Add the turn's node under the node it attached to (its entry says which)."""
    link = turn.tree
    assert link is not None
    parent = tree.nodes[link.parent] if link.parent is not None else None
    tree.add(
        parent,
        delta_messages=turn.messages,
        segment=array("q", [*turn.prompt_tail, *record.completion_ids]),
        prompt_len=record.prompt_len,
        finish_reason=record.finish_reason,
        response_id=link.response_id,
        committed_at=record.timestamp,
        tools=turn.tools,
        template_kwargs=turn.template_kwargs,
    )
    session.records.append(record)
    session.records_bytes += record.size
    session.version += 1


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ResidentRecords:
    """Record bytes held in RAM, oldest first; over the budget, the oldest written ones are
    replaced by SpilledRecords (their bytes stay in the session's file only)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.bytes = 0
        self.spilled = 0
        self._held: OrderedDict[int, tuple[Session, TurnRecord, BodyLocation | None]] = (
            OrderedDict()
        )

    def add(self, session: Session, record: TurnRecord, location: BodyLocation | None) -> None:
        self._held[id(record)] = (session, record, location)
        self.bytes += record.size

    def located(self, record: TurnRecord, location: BodyLocation) -> None:
        held = self._held.get(id(record))
        if held is not None and held[1] is record:
            self._held[id(record)] = (held[0], record, location)

    def drop(self, records: Iterable[TurnRecord]) -> None:
        for record in records:
            held = self._held.get(id(record))
            if held is not None and held[1] is record:
                del self._held[id(record)]
                self.bytes -= record.size

    def enforce(self) -> int:
        """Spill the oldest written records until the rest fit; returns the bytes freed."""
        count = 0
        freed = 0
        for key in list(self._held):
            if self.bytes <= self.budget:
                break
            session, record, location = self._held[key]
            if location is None:
                continue  # still being written (--records-durability none)
            del self._held[key]
            self.bytes -= record.size
            for index, held in enumerate(session.records):
                if held is record:
                    session.records[index] = spill(record, location)
                    count += 1
                    freed += record.size
                    break
        self.spilled += count
        return freed


__all__ = ["RecordsStore", "SpilledRecord", "StoreSettings"]

"""The JSONL trace format: read and write session families (docs/bench.md, "Trace format").

One JSON object per line. An optional first line `{"sessiongate_trace": 1, ...}` carries
workload-wide settings (`tools`, `r3`, and `generator`: how a synthetic trace was made).
Every other line is one session, flat, so a recorder can log sessions independently:

    {"id": "s0", "turns": [{"messages": [...], "max_tokens": 32, "delay_s": 0.0}]}
    {"id": "s0.0", "parent": "s0", "parent_turn": 0, "turns": [...]}

A child names its parent and the parent's turn after whose reply it is spawned; roots are
replayed in file order, siblings in file order. Blank lines are skipped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from sessiongate.loadgen.workload import SessionSpec, TurnSpec

TRACE_VERSION = 1
HEADER_KEY = "sessiongate_trace"


class TraceError(ValueError):
    """The trace file is malformed; the message names the line and field."""


@dataclass(slots=True)
class TraceHeader:
    tools: list[dict[str, Any]] | None = None
    r3: bool = False
    generator: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {HEADER_KEY: TRACE_VERSION, "r3": self.r3}
        if self.tools is not None:
            out["tools"] = self.tools
        if self.generator:
            out["generator"] = self.generator
        return out


def _turn_json(turn: TurnSpec) -> dict[str, Any]:
    out: dict[str, Any] = {
        "messages": turn.messages,
        "max_tokens": turn.max_tokens,
        "delay_s": turn.delay_s,
    }
    if turn.children and not turn.wait_children:
        out["wait_children"] = False
    if turn.body:
        out["body"] = turn.body
    return out


def write_trace(out: TextIO, roots: list[SessionSpec], header: TraceHeader) -> int:
    """Write `header` and every session of `roots` (pre-order); return the session count."""
    out.write(json.dumps(header.to_json(), separators=(",", ":")) + "\n")
    written = 0
    for root in roots:
        for node, parent, parent_turn in root.walk():
            line: dict[str, Any] = {"id": node.id}
            if parent is not None:
                line["parent"] = parent.id
                line["parent_turn"] = parent_turn
            line["turns"] = [_turn_json(t) for t in node.turns]
            out.write(json.dumps(line, ensure_ascii=False, separators=(",", ":")) + "\n")
            written += 1
    return written


def write_trace_file(path: Path, roots: list[SessionSpec], header: TraceHeader) -> int:
    with path.open("w", encoding="utf-8") as out:
        return write_trace(out, roots, header)


def _fail(lineno: int, message: str) -> TraceError:
    return TraceError(f"trace line {lineno}: {message}")


def _messages(value: object, lineno: int, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise _fail(lineno, f"{where}.messages must be a non-empty list (a turn adds something)")
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _fail(lineno, f"{where}.messages[{i}] must be an object with a string 'role'")
    return value


def _number(turn: dict[str, Any], key: str, default: float, lineno: int, where: str) -> float:
    value = turn.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise _fail(lineno, f"{where}.{key} must be a number >= 0, got {value!r}")
    return float(value)


def _turn(raw: object, lineno: int, where: str, default_max_tokens: int) -> TurnSpec:
    if not isinstance(raw, dict):
        raise _fail(lineno, f"{where} must be an object")
    unknown = set(raw) - {"messages", "max_tokens", "delay_s", "wait_children", "body"}
    if unknown:
        raise _fail(lineno, f"{where} has unknown keys {sorted(unknown)}")
    max_tokens = raw.get("max_tokens", default_max_tokens)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise _fail(lineno, f"{where}.max_tokens must be an integer >= 1, got {max_tokens!r}")
    wait = raw.get("wait_children", True)
    if not isinstance(wait, bool):
        raise _fail(lineno, f"{where}.wait_children must be true or false")
    body = raw.get("body", {})
    if not isinstance(body, dict):
        raise _fail(lineno, f"{where}.body must be an object")
    return TurnSpec(
        messages=_messages(raw.get("messages"), lineno, where),
        max_tokens=max_tokens,
        delay_s=_number(raw, "delay_s", 0.0, lineno, where),
        wait_children=wait,
        body=body,
    )


def read_trace(
    source: TextIO, *, default_max_tokens: int = 32
) -> tuple[TraceHeader, list[SessionSpec]]:
    """Parse a trace into its header and root sessions (children linked into their turns)."""
    header = TraceHeader()
    sessions: dict[str, SessionSpec] = {}
    links: list[tuple[int, str, str, int]] = []  # (line, child, parent, parent_turn)
    roots: list[SessionSpec] = []
    for lineno, line in enumerate(source, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise _fail(lineno, f"not JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(obj, dict):
            raise _fail(lineno, "must be a JSON object")
        if HEADER_KEY in obj:
            if sessions:
                raise _fail(lineno, "the header line must come before every session")
            if obj[HEADER_KEY] != TRACE_VERSION:
                raise _fail(lineno, f"unsupported trace version {obj[HEADER_KEY]!r}")
            tools = obj.get("tools")
            if tools is not None and not isinstance(tools, list):
                raise _fail(lineno, "tools must be a list of tool definitions")
            header = TraceHeader(tools, bool(obj.get("r3", False)), obj.get("generator") or {})
            continue
        sid = obj.get("id")
        if not isinstance(sid, str) or not sid:
            raise _fail(lineno, "a session needs a non-empty string 'id'")
        if sid in sessions:
            raise _fail(lineno, f"session id {sid!r} appears twice")
        raw_turns = obj.get("turns")
        if not isinstance(raw_turns, list) or not raw_turns:
            raise _fail(lineno, f"session {sid!r} needs a non-empty 'turns' list")
        turns = [
            _turn(t, lineno, f"session {sid!r} turns[{i}]", default_max_tokens)
            for i, t in enumerate(raw_turns)
        ]
        spec = SessionSpec(sid, turns)
        sessions[sid] = spec
        parent = obj.get("parent")
        if parent is None:
            roots.append(spec)
            continue
        parent_turn = obj.get("parent_turn")
        if not isinstance(parent, str):
            raise _fail(lineno, f"session {sid!r}: parent must be a session id string")
        if isinstance(parent_turn, bool) or not isinstance(parent_turn, int) or parent_turn < 0:
            raise _fail(lineno, f"session {sid!r}: a child needs parent_turn (an integer >= 0)")
        links.append((lineno, sid, parent, parent_turn))
    for lineno, sid, parent, parent_turn in links:
        owner = sessions.get(parent)
        if owner is None:
            raise _fail(lineno, f"session {sid!r}: parent {parent!r} is not in the trace")
        if parent_turn >= len(owner.turns):
            raise _fail(
                lineno,
                f"session {sid!r}: parent_turn {parent_turn} but {parent!r} has "
                f"{len(owner.turns)} turns",
            )
        owner.turns[parent_turn].children.append(sessions[sid])
    reachable = sum(root.count()[0] for root in roots)
    if reachable != len(sessions):
        raise TraceError("trace has sessions that no root reaches (a parent cycle)")
    return header, roots


def read_trace_file(
    path: Path, *, default_max_tokens: int = 32
) -> tuple[TraceHeader, list[SessionSpec]]:
    with path.open(encoding="utf-8") as source:
        return read_trace(source, default_max_tokens=default_max_tokens)

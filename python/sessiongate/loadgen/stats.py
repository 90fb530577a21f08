"""Per-request records, live counters, and the run summary (percentiles, rates, errors).

Figures cover measured requests only (`warmup` False). Rates divide by the measured window:
from the first measured request's start to the last one's end.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from typing import Any

from sessiongate.loadgen.http import Exchange
from sessiongate.loadgen.tree_check import TreeTally

RATE_WINDOW_S = 5.0  # "current rate" in the progress display: turns over the last 5 s


@dataclass(slots=True)
class RequestRecord:
    """One line of `--raw`: who sent it, what was sent, what came back."""

    kind: str  # create | chat | records | samples (tree sessions) | delete
    session_id: str | None
    parent_id: str | None
    root_id: str | None
    trace_id: str  # the workload's id of the session ("s3.0")
    turn: int | None  # 0-based turn index for chats
    final: bool  # the session's last turn
    start_s: float  # since the run started
    latency_s: float
    ttft_s: float | None
    status: int | None
    error_key: str | None
    error: str | None
    bytes_sent: int
    bytes_received: int
    prompt_tokens: int | None
    completion_tokens: int | None
    headers: dict[str, str]
    body_stamp: dict[str, Any] | None
    warmup: bool

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        if out["body_stamp"] is None:
            del out["body_stamp"]
        return out


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]) of unsorted values; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def distribution_ms(values_s: list[float]) -> dict[str, float | int] | None:
    if not values_s:
        return None
    ms = [v * 1000.0 for v in values_s]
    out: dict[str, float | int] = {"count": len(ms)}
    for q in (50, 90, 99):
        out[f"p{q}"] = round(percentile(ms, q) or 0.0, 3)
    out["mean"] = round(sum(ms) / len(ms), 3)
    out["min"] = round(min(ms), 3)
    out["max"] = round(max(ms), 3)
    return out


@dataclass(slots=True)
class Collector:
    """Everything a run observed; the driver feeds it, progress and report read it."""

    t0: float = field(default_factory=time.perf_counter)
    records: list[RequestRecord] = field(default_factory=list)
    sessions_planned: int | None = None  # sessions of the whole workload, when known
    sessions_started: int = 0
    sessions_done: int = 0
    sessions_failed: int = 0
    trees_done: int = 0
    turns_done: int = 0
    errors: int = 0
    warmup_until_s: float | None = None  # requests starting before this are warm-up
    tree: TreeTally | None = None  # tree workloads: the tree figures (summary["tree"])
    _recent: deque[float] = field(default_factory=deque)

    def add(
        self,
        ex: Exchange,
        *,
        session: tuple[str | None, str | None, str | None],
        trace_id: str,
        turn: int | None = None,
        final: bool = False,
        warmup: bool = False,
    ) -> RequestRecord:
        start_s = ex.started - self.t0
        if self.warmup_until_s is not None and start_s < self.warmup_until_s:
            warmup = True
        record = RequestRecord(
            kind=ex.kind,
            session_id=session[0],
            parent_id=session[1],
            root_id=session[2],
            trace_id=trace_id,
            turn=turn,
            final=final,
            start_s=round(start_s, 6),
            latency_s=round(ex.latency_s, 6),
            ttft_s=None if ex.ttft_s is None else round(ex.ttft_s, 6),
            status=ex.status,
            error_key=ex.error_key,
            error=ex.error,
            bytes_sent=ex.bytes_sent,
            bytes_received=ex.bytes_received,
            prompt_tokens=ex.prompt_tokens,
            completion_tokens=ex.completion_tokens,
            headers=ex.headers,
            body_stamp=ex.body_stamp,
            warmup=warmup,
        )
        self.records.append(record)
        if ex.error_key is not None:
            self.errors += 1
        if ex.kind == "chat" and ex.ok:
            self.turns_done += 1
            now = time.perf_counter()
            self._recent.append(now)
        return record

    def current_rate(self) -> float:
        """Successful turns per second over the last few seconds."""
        now = time.perf_counter()
        while self._recent and now - self._recent[0] > RATE_WINDOW_S:
            self._recent.popleft()
        span = min(RATE_WINDOW_S, now - self.t0)
        return len(self._recent) / span if span > 0 else 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def summarize(collector: Collector, *, interrupted: bool = False) -> dict[str, Any]:
    """The summary `--json` writes and the table shows."""
    measured = [r for r in collector.records if not r.warmup]
    chats = [r for r in measured if r.kind == "chat"]
    ok_chats = [r for r in chats if r.error_key is None]
    if measured:
        begin = min(r.start_s for r in measured)
        end = max(r.start_s + r.latency_s for r in measured)
        window = max(end - begin, 1e-9)
    else:
        window = 0.0

    def per_s(value: float) -> float | None:
        return round(value / window, 3) if window else None

    completion = sum(r.completion_tokens or 0 for r in ok_chats)
    prompt = sum(r.prompt_tokens or 0 for r in ok_chats)
    gets = [r for r in measured if r.kind == "records" and r.error_key is None]
    errors = Counter(r.error_key for r in measured if r.error_key is not None)
    errors_by_kind = Counter(r.kind for r in measured if r.error_key is not None)
    warmup_errors = sum(1 for r in collector.records if r.warmup and r.error_key is not None)
    ttfts = [r.ttft_s for r in ok_chats if r.ttft_s is not None]
    return {
        "interrupted": interrupted,
        "wall_s": round(collector.elapsed(), 3),
        "measured_s": round(window, 3),
        "sessions": {
            "started": collector.sessions_started,
            "completed": collector.sessions_done - collector.sessions_failed,
            "failed": collector.sessions_failed,
            "trees_completed": collector.trees_done,
        },
        "turns": {
            "sent": len(chats),
            "ok": len(ok_chats),
            "per_s": per_s(len(ok_chats)),
        },
        "tokens": {
            "prompt": prompt,
            "completion": completion,
            "completion_per_s": per_s(completion),
            "total_per_s": per_s(prompt + completion),
        },
        "latency_ms": distribution_ms([r.latency_s for r in ok_chats]),
        "ttft_ms": distribution_ms(ttfts),
        "records_get": None
        if not gets
        else {
            "latency_ms": distribution_ms([r.latency_s for r in gets]),
            "bytes_total": sum(r.bytes_received for r in gets),
            "bytes_mean": round(sum(r.bytes_received for r in gets) / len(gets), 1),
            "bytes_max": max(r.bytes_received for r in gets),
        },
        "requests": {
            kind: len([r for r in measured if r.kind == kind])
            for kind in ("create", "chat", "records", "delete")
            + (("samples",) if collector.tree is not None else ())
        },
        "errors": {
            "total": sum(errors.values()),
            "by_status": dict(sorted(errors.items())),
            "by_request": dict(sorted(errors_by_kind.items())),
            "warmup": warmup_errors,
        },
        "warmup_requests": len(collector.records) - len(measured),
        **({"tree": collector.tree.to_json()} if collector.tree is not None else {}),
    }

"""Gateway metrics in the Prometheus text exposition format (no client library needed): one
renderer for both layouts, the in-process core being the one worker of its gauges."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sessiongate.build import build_labels
from sessiongate.engines.registry import BadEngineUrl, normalise_url

# Reasons of sessiongate_rejected_total, always all rendered so a dashboard sees the series.
REJECT_REASONS = ("max_sessions", "records_budget")
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)


@dataclass
class _Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))
    total: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        self.total += seconds
        self.count += 1
        for index, bound in enumerate(LATENCY_BUCKETS):
            if seconds <= bound:
                self.counts[index] += 1


@dataclass
class WorkerGauge:
    index: int
    up: bool
    sessions: int
    inflight: int
    bytes_relayed: int
    affinity_hits: int = 0
    repins: int = 0
    # Abuse limits (0 = off) and their usage (docs/reliability.md, "Limits").
    records_bytes: int = 0
    max_records_bytes: int = 0
    max_sessions: int = 0
    sessions_expired: int = 0
    # The records store (--records-dir): record bytes in RAM, records spilled to their files,
    # writes the directory refused.
    records_resident_bytes: int = 0
    records_spilled: int = 0
    records_write_errors: int = 0
    # Requests refused by a limit, by reason (REJECT_REASONS).
    rejected: dict[str, int] = field(default_factory=dict)
    # (url, healthy) of each upstream the worker sends turns to.
    upstreams: list[tuple[str, bool]] = field(default_factory=list)
    # (url, circuit breaker state 0 closed / 1 open / 2 half-open, retries it caused).
    upstream_reliability: list[tuple[str, int, int]] = field(default_factory=list)
    # Seconds since the worker's last heartbeat (None before the first), and whether that
    # silence makes it "stalled" (as /health says).
    heartbeat_age_s: float | None = None
    stalled: bool = False
    # Remote (TCP) workers only.
    address: str | None = None
    transport: str = ""
    state: str = ""
    reconnects: int = 0
    connect_failures: int = 0


@dataclass
class EngineGauge:
    """One engine of the set as /metrics shows it: summed over every path that sends to it
    (the compiled front's own relay, each worker's or the in-process core's pool)."""

    url: str
    healthy: bool
    in_flight: int = 0
    sent: int = 0
    # Prompt tokens the engine was believed to hold and had lost (replies' cached_tokens).
    lost: int = 0
    # Held by a pause (docs/routing.md, "Weight versions and pauses"), and the weight
    # version the registry last learned (None: not known).
    paused: bool = False
    weight_version: str | None = None


def engine_gauges(
    engines: Sequence[tuple[str, bool]],
    counts: Sequence[Sequence[Mapping[str, Any]]],
    front: Mapping[str, Any] | None = None,
    states: Mapping[str, tuple[bool, str | None]] | None = None,
) -> list[EngineGauge]:
    """`engines`: (url, healthy) of the set, as the engine registry knows it; `counts`: each
    pool's `[{"url", "in_flight", "sent"}]` (`EnginePool.engine_counts`, the workers'
    heartbeats); `front`: the compiled front's stats, whose `upstreams` carry the same two
    numbers for the stateless requests it relays itself; `states`: (paused, weight version)
    by URL. Counts of engines no longer in the set are left out."""
    gauges = {_key(url): EngineGauge(url, healthy) for url, healthy in engines}
    for url, (paused, version) in (states or {}).items():
        known = gauges.get(_key(url))
        if known is not None:
            known.paused, known.weight_version = paused, version
    sources = [*counts, list(front.get("upstreams", [])) if front else []]
    for source in sources:
        for entry in source:
            # The pools start from the `--backend` text as given, the registry normalises it.
            gauge = gauges.get(_key(str(entry.get("url", ""))))
            if gauge is not None:
                gauge.in_flight += int(entry.get("in_flight", 0))
                gauge.sent += int(entry.get("sent", 0))
                gauge.lost += int(entry.get("lost", 0))
    return list(gauges.values())


def _key(url: str) -> str:
    try:
        return normalise_url(url)
    except BadEngineUrl:
        return url


class RouterMetrics:
    def __init__(self) -> None:
        self.requests: Counter[tuple[str, int]] = Counter()
        self.latency: dict[str, _Histogram] = {}

    def observe(self, op: str, status: int, seconds: float) -> None:
        self.requests[(op, status)] += 1
        self.latency.setdefault(op, _Histogram()).observe(seconds)

    def render(
        self,
        workers: Sequence[WorkerGauge],
        front: Mapping[str, Any] | None = None,
        engines: Sequence[EngineGauge] = (),
        *,
        worker_restarts: int = 0,
    ) -> bytes:
        """`front`: the compiled front's counters (`_core.CompiledFront.stats`), whose
        stateless proxy requests never reach this process's handler: counted as op "proxy".
        `engines`: the per-engine gauges (`engine_gauges`); `worker_restarts`: workers
        replaced after they exited."""
        requests, latency = self.requests, self.latency
        if front:
            requests, latency = _with_front(requests, latency, front)
        lines: list[str] = []
        _request_families(lines, requests, latency)
        _worker_families(lines, workers)
        _upstream_families(lines, workers, engines)
        _limits_families(lines, workers)
        if front:
            _front_families(lines, front)
        _remote_families(lines, workers)
        _family(
            lines,
            "sessiongate_worker_restarts_total",
            "counter",
            "Workers replaced after they exited.",
            [("", worker_restarts)],
        )
        return ("\n".join(lines) + "\n").encode()


def _request_families(
    lines: list[str], requests: Mapping[tuple[str, int], int], latency: Mapping[str, _Histogram]
) -> None:
    """The build, and the requests answered by operation and status, with their latency."""
    _family(
        lines,
        "sessiongate_build_info",
        "gauge",
        "1, labelled with the package version and the Rust core's build.",
        [(",".join(f'{k}="{_label(v)}"' for k, v in build_labels().items()), 1)],
    )
    _family(
        lines,
        "sessiongate_requests_total",
        "counter",
        "Requests answered by the router, by operation and status.",
        [(f'op="{op}",status="{st}"', n) for (op, st), n in sorted(requests.items())],
    )
    samples: list[tuple[str, float]] = []
    for op, hist in sorted(latency.items()):
        for bound, count in zip(LATENCY_BUCKETS, hist.counts, strict=True):
            samples.append((f'op="{op}",le="{bound}"', count))  # counts are cumulative
        samples.append((f'op="{op}",le="+Inf"', hist.count))
    _family(
        lines,
        "sessiongate_request_duration_seconds",
        "histogram",
        "Time from request to the reply's status line.",
        samples,
        suffix="_bucket",
    )
    for op, hist in sorted(latency.items()):
        lines.append(f'sessiongate_request_duration_seconds_sum{{op="{op}"}} {hist.total:.6f}')
        lines.append(f'sessiongate_request_duration_seconds_count{{op="{op}"}} {hist.count}')


def _worker_families(lines: list[str], workers: Sequence[WorkerGauge]) -> None:
    """Each worker's liveness and load (the in-process core is worker 0)."""
    per_worker = {
        "sessiongate_worker_up": ("gauge", "1 when the worker's channel is open and beating."),
        "sessiongate_worker_sessions": ("gauge", "Live sessions (last heartbeat)."),
        "sessiongate_worker_inflight": ("gauge", "Requests being handled (last heartbeat)."),
        "sessiongate_bytes_relayed_total": ("counter", "Reply body bytes relayed."),
        "sessiongate_worker_stalled": (
            "gauge",
            "1 when the worker is connected but has sent no heartbeat for two beats.",
        ),
    }
    values = {
        "sessiongate_worker_up": lambda w: int(w.up),
        "sessiongate_worker_sessions": lambda w: w.sessions,
        "sessiongate_worker_inflight": lambda w: w.inflight,
        "sessiongate_bytes_relayed_total": lambda w: w.bytes_relayed,
        "sessiongate_worker_stalled": lambda w: int(w.stalled),
    }
    for name, (kind, text) in per_worker.items():
        _family(
            lines, name, kind, text, [(f'worker="{w.index}"', values[name](w)) for w in workers]
        )
    _family(
        lines,
        "sessiongate_worker_heartbeat_age_seconds",
        "gauge",
        "Seconds since the worker's last heartbeat (absent before the first).",
        [
            (f'worker="{w.index}"', round(w.heartbeat_age_s, 3))
            for w in workers
            if w.heartbeat_age_s is not None
        ],
    )


def _upstream_families(
    lines: list[str], workers: Sequence[WorkerGauge], engines: Sequence[EngineGauge]
) -> None:
    """The engines as each worker's pool sees them, and the engines of the set."""
    _family(
        lines,
        "sessiongate_upstream_affinity_hits_total",
        "counter",
        "Turns sent to the engine their session family was already pinned to.",
        [(f'worker="{w.index}"', w.affinity_hits) for w in workers],
    )
    _family(
        lines,
        "sessiongate_upstream_repins_total",
        "counter",
        "Session families moved to another engine after theirs failed.",
        [(f'worker="{w.index}"', w.repins) for w in workers],
    )
    _family(
        lines,
        "sessiongate_upstream_up",
        "gauge",
        "1 when the engine answers (health probe or last request), by worker and URL.",
        [
            (f'worker="{w.index}",url="{_label(url)}"', int(up))
            for w in workers
            for url, up in w.upstreams
        ],
    )
    _engine_families(lines, engines)
    _family(
        lines,
        "sessiongate_upstream_circuit_breaker_state",
        "gauge",
        "The engine's circuit breaker: 0 closed, 1 open, 2 half-open, by worker and URL.",
        [
            (f'worker="{w.index}",url="{_label(url)}"', state)
            for w in workers
            for url, state, _ in w.upstream_reliability
        ],
    )
    _family(
        lines,
        "sessiongate_upstream_retries_total",
        "counter",
        "Requests sent again after the engine refused a connection or answered 429 / 503.",
        [
            (f'worker="{w.index}",url="{_label(url)}"', retries)
            for w in workers
            for url, _, retries in w.upstream_reliability
        ],
    )


def _remote_families(lines: list[str], workers: Sequence[WorkerGauge]) -> None:
    """Remote (TCP) workers' addresses and connections; nothing without one."""
    remote = [w for w in workers if w.address is not None]
    if not remote:
        return
    _family(
        lines,
        "sessiongate_worker_info",
        "gauge",
        "Remote workers: address, transport and connection state (value 1).",
        [
            (
                f'worker="{w.index}",address="{w.address}",transport="{w.transport}",'
                f'state="{w.state}"',
                1,
            )
            for w in remote
        ],
    )
    _family(
        lines,
        "sessiongate_worker_reconnects_total",
        "counter",
        "Connections to a remote worker re-established after the first.",
        [(f'worker="{w.index}",address="{w.address}"', w.reconnects) for w in remote],
    )
    _family(
        lines,
        "sessiongate_worker_connect_failures_total",
        "counter",
        "Failed connection attempts to a remote worker (refused, timed out, handshake).",
        [(f'worker="{w.index}",address="{w.address}"', w.connect_failures) for w in remote],
    )


def _label(value: str) -> str:
    """A label value escaped as the exposition format requires."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _engine_families(lines: list[str], engines: Sequence[EngineGauge]) -> None:
    label = [f'engine="{_label(e.url)}"' for e in engines]
    _family(
        lines,
        "sessiongate_engine_requests_in_flight",
        "gauge",
        "Requests sent to the engine and not yet relayed back (every worker and the compiled "
        "front; workers' counts are as of their last heartbeat).",
        [(lab, e.in_flight) for lab, e in zip(label, engines, strict=True)],
    )
    _family(
        lines,
        "sessiongate_engine_requests_total",
        "counter",
        "Requests sent to the engine (each attempt, retries included), session turns and "
        "stateless requests alike.",
        [(lab, e.sent) for lab, e in zip(label, engines, strict=True)],
    )
    _family(
        lines,
        "sessiongate_engine_prefix_lost_tokens_total",
        "counter",
        "Prompt tokens cache_aware believed the engine held and the engine's reply showed it "
        "had lost (its cached_tokens more than 64 short): what it then forgot of the engine.",
        [(lab, e.lost) for lab, e in zip(label, engines, strict=True)],
    )
    _family(
        lines,
        "sessiongate_engine_healthy",
        "gauge",
        "1 when the engine registry's last probe of the engine passed.",
        [(lab, int(e.healthy)) for lab, e in zip(label, engines, strict=True)],
    )
    _family(
        lines,
        "sessiongate_engine_paused",
        "gauge",
        "1 while the engine is paused (through the RL control plane, or seen by its /ready): "
        "it gets no new request.",
        [(lab, int(e.paused)) for lab, e in zip(label, engines, strict=True)],
    )
    _family(
        lines,
        "sessiongate_engine_weight_version",
        "gauge",
        "1 for the weight version the engine samples with, as the gateway last learned it.",
        [
            (f'{lab},weight_version="{_label(e.weight_version)}"', 1)
            for lab, e in zip(label, engines, strict=True)
            if e.weight_version is not None
        ],
    )


def _limits_families(lines: list[str], workers: Sequence[WorkerGauge]) -> None:
    _family(
        lines,
        "sessiongate_worker_records_bytes",
        "gauge",
        "Bytes of turn records (request + response bodies) a worker holds (last heartbeat).",
        [(f'worker="{w.index}"', w.records_bytes) for w in workers],
    )
    _family(
        lines,
        "sessiongate_records_bytes_limit",
        "gauge",
        "--max-records-bytes of a worker: new turns get a 503 at or above it (0: no limit).",
        [(f'worker="{w.index}"', w.max_records_bytes) for w in workers],
    )
    _family(
        lines,
        "sessiongate_sessions_limit",
        "gauge",
        "--max-sessions of a worker: one more session is a 429 (0: no limit).",
        [(f'worker="{w.index}"', w.max_sessions) for w in workers],
    )
    _family(
        lines,
        "sessiongate_rejected_total",
        "counter",
        "Requests refused by a limit: max_sessions (429) or records_budget (503).",
        [
            (f'worker="{w.index}",reason="{reason}"', w.rejected.get(reason, 0))
            for w in workers
            for reason in REJECT_REASONS
        ],
    )
    _family(
        lines,
        "sessiongate_worker_records_resident_bytes",
        "gauge",
        "Record bytes a worker holds in RAM (with --records-dir, at most --records-memory).",
        [(f'worker="{w.index}"', w.records_resident_bytes) for w in workers],
    )
    _family(
        lines,
        "sessiongate_records_spilled_total",
        "counter",
        "Records whose bytes left RAM for their session's file (--records-memory).",
        [(f'worker="{w.index}"', w.records_spilled) for w in workers],
    )
    _family(
        lines,
        "sessiongate_records_write_errors_total",
        "counter",
        "Writes the records directory refused (the turn got a 507 unless durability none).",
        [(f'worker="{w.index}"', w.records_write_errors) for w in workers],
    )
    _family(
        lines,
        "sessiongate_sessions_expired_total",
        "counter",
        "Sessions closed after their idle TTL (--session-ttl, --header-session-ttl).",
        [(f'worker="{w.index}"', w.sessions_expired) for w in workers],
    )


def _family(
    lines: list[str],
    name: str,
    kind: str,
    text: str,
    samples: Sequence[tuple[str, float]],
    suffix: str = "",
) -> None:
    lines.append(f"# HELP {name} {text}")
    lines.append(f"# TYPE {name} {kind}")
    for labels, value in samples:
        label_text = f"{{{labels}}}" if labels else ""
        lines.append(f"{name}{suffix}{label_text} {value}")


def _with_front(
    requests: Counter[tuple[str, int]],
    latency: dict[str, _Histogram],
    front: Mapping[str, Any],
) -> tuple[Counter[tuple[str, int]], dict[str, _Histogram]]:
    """The router's own counts plus the compiled front's, as op "proxy"."""
    merged = Counter(requests)
    for status, count in front.get("requests", {}).items():
        merged[("proxy", int(status))] += int(count)
    hist = front.get("latency", {})
    if not hist.get("count"):
        return merged, latency
    own = latency.get("proxy", _Histogram())
    combined = _Histogram(
        counts=[a + int(b) for a, b in zip(own.counts, hist["buckets"], strict=True)],
        total=own.total + float(hist["sum"]),
        count=own.count + int(hist["count"]),
    )
    return merged, {**latency, "proxy": combined}


def _front_families(lines: list[str], front: Mapping[str, Any]) -> None:
    _family(
        lines,
        "sessiongate_front_connections",
        "gauge",
        "Client connections the compiled front is serving itself.",
        [("", int(front.get("connections", 0)))],
    )
    _family(
        lines,
        "sessiongate_front_handoffs_total",
        "counter",
        "Connections the compiled front handed to the Python server (session traffic, "
        "health, errors it does not answer itself).",
        [("", int(front.get("handoffs", 0)))],
    )
    _family(
        lines,
        "sessiongate_front_upstream_up",
        "gauge",
        "1 when the engine answers the compiled front's probes and requests, by URL.",
        [
            (f'url="{_label(str(u.get("url")))}"', int(bool(u.get("healthy"))))
            for u in front.get("upstreams", [])
        ],
    )
    _family(
        lines,
        "sessiongate_front_upstream_circuit_breaker_state",
        "gauge",
        "The compiled front's circuit breaker of the engine: 0 closed, 1 open, 2 half-open.",
        [
            (f'url="{_label(url)}"', state)
            for url, state, _ in reliability_gauges(front.get("upstreams", []))
        ],
    )
    _family(
        lines,
        "sessiongate_front_upstream_retries_total",
        "counter",
        "Requests the compiled front sent again after the engine refused a connection or "
        "answered 429 / 503.",
        [
            (f'url="{_label(url)}"', retries)
            for url, _, retries in reliability_gauges(front.get("upstreams", []))
        ],
    )


# The breaker states as /health names them, and their gauge values.
BREAKER_STATES = {"closed": 0, "open": 1, "half_open": 2}


def reliability_gauges(upstreams: Sequence[Any]) -> list[tuple[str, int, int]]:
    """(url, breaker state value, retries) of each upstream state `/health` shows."""
    return [
        (
            str(u.get("url")),
            BREAKER_STATES.get(str(u.get("circuit_breaker")), 0),
            int(u.get("retries", 0)),
        )
        for u in upstreams
        if isinstance(u, dict)
    ]

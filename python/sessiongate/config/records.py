"""The limits and records sections: what one session core may hold (live sessions, record
bytes, idle expiry) and where its records are kept (docs/reliability.md, "Limits";
docs/deployment.md, "Durable records")."""

from __future__ import annotations

from dataclasses import dataclass

from sessiongate.config.fields import option, section

DEFAULT_MAX_SESSIONS = 10_000
# Freed records' memory kept mapped across quiet spells (docs/reliability.md).
DEFAULT_WARM_RECORDS = "1G"
AUTO = "auto"
# When a turn is acknowledged (docs/deployment.md).
DURABILITIES = ("none", "flush", "fsync")


@section(title="abuse limits (per worker; docs/reliability.md)", key="limits")
@dataclass(frozen=True)
class LimitsConfig:
    max_sessions: int = option(
        "--max-sessions",
        default=DEFAULT_MAX_SESSIONS,
        parse=int,
        metavar="N",
        help="live sessions per worker; creating one more (POST /sessions, a child, a "
        f"header-identified session) is a 429 with Retry-After ({DEFAULT_MAX_SESSIONS}; "
        "0 = unlimited)",
    )
    max_records_bytes: str = option(
        "--max-records-bytes",
        default=AUTO,
        metavar="BYTES",
        help="turn records (request + response bytes) a worker holds before new turns are "
        "refused with a 503 and Retry-After; K/M/G/T suffixes are powers of 1024 (auto: half "
        "of the machine's memory or cgroup limit, split over the local workers; 0 = "
        "unlimited)",
    )
    warm_records_bytes: str = option(
        "--warm-records-bytes",
        default=DEFAULT_WARM_RECORDS,
        metavar="BYTES",
        help="memory of freed records a worker keeps mapped when it gives the rest back to "
        "the OS after 10 quiet seconds, so the next sessions' records reuse it warm instead "
        "of paying the kernel's first touch (about 3x the CPU of an R3 turn); with --r3 it "
        "is also touched at start, for the first sessions; K/M/G "
        f"suffixes ({DEFAULT_WARM_RECORDS}; 0 = give it all back, touch nothing)",
    )
    session_ttl: float = option(
        "--session-ttl",
        default=0.0,
        parse=float,
        metavar="SECONDS",
        help="close sessions created by POST /sessions after this many idle seconds, as "
        "--header-session-ttl does for header sessions; later requests for them get a 404 "
        "saying so (0, the default: never)",
    )


@section(title="durable records (docs/deployment.md)", key="records")
@dataclass(frozen=True)
class RecordsConfig:
    dir: str | None = option(
        "--records-dir",
        metavar="DIR",
        help="persist every session and turn record under DIR and recover them when a "
        "worker restarts (serve: one DIR/worker-N per worker); default: in memory only",
    )
    durability: str | None = option(
        "--records-durability",
        choices=DURABILITIES,
        help="when a turn is acknowledged: none (queued for writing; a worker crash may lose "
        "the last turns), flush (written to the OS before the reply: survives a worker "
        "crash; default), fsync (on the disk before the reply: survives a host crash)",
    )
    memory: str | None = option(
        "--records-memory",
        metavar="BYTES",
        help="with --records-dir, record bytes a worker keeps in RAM; older records are read "
        "from their files (auto: as --max-records-bytes auto; K/M/G suffixes)",
    )
    # serve -> its workers: how many shards the directory is split into.
    shards: int = option("--records-shards", default=0, parse=int, hidden=True, help="")

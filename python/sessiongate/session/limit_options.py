"""Command-line options of the abuse limits (live sessions, records memory, idle expiry of
path-created sessions), shared by `serve`, the worker processes and `sessiongate worker`:
declared once, validated once, forwarded to workers as argv (docs/reliability.md, "Limits").
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any

DEFAULT_MAX_SESSIONS = 10_000
AUTO = "auto"
# Share of the machine's memory (or its cgroup limit) that the records of all local workers
# may hold by default. Records are not all a worker holds: token-id checkpoints, the GIL-free
# parse buffers of replies in flight and GET/trajectory/samples assembly come on top, so
# half is left for those and for everything else on the host.
AUTO_MEMORY_FRACTION = 0.5
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
# cgroup v2, then v1: a container's limit is what the OOM killer enforces, not the host's RAM.
_CGROUP_LIMITS = (
    Path("/sys/fs/cgroup/memory.max"),
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
)


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("abuse limits (per worker; docs/reliability.md)")
    group.add_argument(
        "--max-sessions",
        type=int,
        default=DEFAULT_MAX_SESSIONS,
        metavar="N",
        help="live sessions per worker; creating one more (POST /sessions, a child, a "
        f"header-identified session) is a 429 with Retry-After ({DEFAULT_MAX_SESSIONS}; "
        "0 = unlimited)",
    )
    group.add_argument(
        "--max-records-bytes",
        default=AUTO,
        metavar="BYTES",
        help="turn records (request + response bytes) a worker holds before new turns are "
        "refused with a 503 and Retry-After; K/M/G/T suffixes are powers of 1024 (auto: half "
        "of the machine's memory or cgroup limit, split over the local workers; 0 = "
        "unlimited)",
    )
    group.add_argument(
        "--session-ttl",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="close sessions created by POST /sessions after this many idle seconds, as "
        "--header-session-ttl does for header sessions; later requests for them get a 404 "
        "saying so (0, the default: never)",
    )


def parse_size(text: str) -> int:
    """`8G`, `512MiB`, `1.5g`, `1048576` -> bytes (ValueError when not a size)."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a byte count (e.g. 8G, 512M, 1048576, 0)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def memory_bytes() -> int:
    """Physical memory, or the cgroup's memory limit when that is lower."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for path in _CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            # v1 reports "no limit" as a huge number, v2 as "max": min() handles both.
            total = min(total, int(text))
    return total


def auto_records_bytes(workers: int) -> int:
    """The default budget of each of `workers` workers sharing this machine."""
    return int(memory_bytes() * AUTO_MEMORY_FRACTION) // max(1, workers)


def records_budget(args: argparse.Namespace, workers: int = 1) -> int:
    """--max-records-bytes in bytes (`auto` sized for `workers` on this machine)."""
    return memory_option(args.max_records_bytes, "--max-records-bytes", workers)


def memory_option(value: object, flag: str, workers: int = 1) -> int:
    """A byte-count option that may be `auto` (each of `workers` workers' share of this
    machine's memory); SystemExit naming `flag` when it is neither."""
    text = str(value)
    if text.strip().lower() == AUTO:
        return auto_records_bytes(workers)
    try:
        return parse_size(text)
    except ValueError as exc:
        raise SystemExit(f"{flag}: {exc}") from None


def limit_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The SessionSettings fields of these options, validated (SystemExit on bad values).

    `auto` resolves for one core on this machine: `serve` hands local workers their share
    as a number (limit_argv), so `auto` reaches only the in-process gateway and standalone
    `sessiongate worker` processes."""
    if args.max_sessions < 0:
        raise SystemExit("--max-sessions must be >= 0 (0 = unlimited)")
    if not args.session_ttl >= 0:  # also rejects nan
        raise SystemExit("--session-ttl must be >= 0 (0 = never)")
    return {
        "max_sessions": args.max_sessions,
        "max_records_bytes": records_budget(args),
        "session_ttl": args.session_ttl,
    }


def limit_argv(args: argparse.Namespace, local_workers: int | None) -> list[str]:
    """These options as the argv a worker process is started with. `local_workers`: how many
    workers share this machine's memory (`auto` is split over them here); None for workers
    placed elsewhere (Ray), which resolve `auto` on their own host."""
    budget = (
        str(args.max_records_bytes)
        if local_workers is None and str(args.max_records_bytes).strip().lower() == AUTO
        else str(records_budget(args, local_workers or 1))
    )
    return [
        "--max-sessions",
        str(args.max_sessions),
        "--max-records-bytes",
        budget,
        "--session-ttl",
        repr(args.session_ttl),
    ]

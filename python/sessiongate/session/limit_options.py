"""The abuse limits' settings from the limits options (live sessions, records memory, idle
expiry of path-created sessions), and the byte counts they are written in
(docs/reliability.md, "Limits"). The options are declared in config/records.py.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

from sessiongate.config.fields import flag_of
from sessiongate.config.records import AUTO, LimitsConfig

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


def records_budget(limits: LimitsConfig, workers: int = 1) -> int:
    """--max-records-bytes in bytes (`auto` sized for `workers` on this machine)."""
    flag = flag_of(LimitsConfig, "max_records_bytes")
    return memory_option(limits.max_records_bytes, flag, workers)


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


def limit_settings(limits: LimitsConfig) -> dict[str, Any]:
    """The SessionSettings fields of these options, validated (SystemExit on bad values).

    `auto` resolves for one core on this machine: `serve` hands local workers their share
    as a number (limits_for_workers), so `auto` reaches only the in-process gateway and
    standalone `sessiongate worker` processes."""
    if limits.max_sessions < 0:
        raise SystemExit("--max-sessions must be >= 0 (0 = unlimited)")
    if not limits.session_ttl >= 0:  # also rejects nan
        raise SystemExit("--session-ttl must be >= 0 (0 = never)")
    warm_flag = flag_of(LimitsConfig, "warm_records_bytes")
    try:
        warm = parse_size(str(limits.warm_records_bytes))
    except ValueError as exc:
        raise SystemExit(f"{warm_flag}: {exc}") from None
    return {
        "max_sessions": limits.max_sessions,
        "max_records_bytes": records_budget(limits),
        "warm_records_bytes": warm,
        "session_ttl": limits.session_ttl,
    }


def limits_for_workers(limits: LimitsConfig, local_workers: int | None) -> LimitsConfig:
    """The limits `serve` hands its workers. `local_workers`: how many workers share this
    machine's memory (`auto` is split over them here); None for workers placed elsewhere
    (Ray), which resolve `auto` on their own host."""
    if local_workers is None and str(limits.max_records_bytes).strip().lower() == AUTO:
        return limits
    budget = str(records_budget(limits, local_workers or 1))
    return dataclasses.replace(limits, max_records_bytes=budget)

"""What a worker says about itself, whichever way its router reaches it (an inherited
socket under `serve`, TCP as `sessiongate worker` or a Ray actor's worker): its part of each
heartbeat, and the note its 404s carry after it replaced a lost worker."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sessiongate.session.core import SessionCore


def restart_note(index: int) -> str:
    """Appended to 404s for unknown sessions by a worker that replaced a lost one."""
    return (
        f" (worker {index} was restarted at {time.strftime('%H:%M:%S')}; sessions it "
        "held before were lost with the previous worker process)"
    )


def core_status(core: SessionCore) -> dict[str, Any]:
    """The core's part of each heartbeat."""
    return {
        "sessions": len(core.sessions),
        "turns_recorded": core.turns_recorded,
        "turns_aborted": core.turns_aborted,
        "rollbacks": core.rollbacks,
        "rollback_steps": core.rollback_steps,
        "r3_missing_turns": core.r3_missing_turns,
        "relay_buffered_turns": core.relay_buffered_turns,
        "affinity_hits": core.upstream.affinity_hits,
        "repins": core.upstream.repins,
        "sessions_ended": core.stamper.ended if core.stamper else 0,
        # The router reports these per worker in /health and as sessiongate_upstream_up.
        "upstream": "down" if core.upstream.all_down else "ok",
        "upstreams": core.upstream.upstream_states(),
        # Per engine: requests in flight and sent (the router sums them over its workers for
        # /metrics' per-engine gauges).
        "engines": core.upstream.engine_counts(),
        # Limits and their usage: the router shows them per worker in /health and /metrics.
        **core.limits_status(),
    }

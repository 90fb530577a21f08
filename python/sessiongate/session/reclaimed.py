"""Reclaimed session ids: a deleted session answers 410 Gone, not 404, for a while.

A trainer deletes a session once it has taken the samples; an agent that is still running
(a late tool result, a retry) then sends a turn to it. A 404 there reads like a typo or a
routing bug; 410 says the session existed and was reclaimed on purpose, so the agent should
stop, not retry. The rollout framework's session server does the same with a bounded set of
tombstones (4096 ids for an hour), and so does this: the ids are kept by deletion time,
oldest dropped first past `limit`, each forgotten `ttl` seconds after its deletion. Ids never
seen stay 404.

With a records directory the tombstones survive a restart: each deletion is appended to a
small text file there (`reclaimed`, one `<id> <unix time>` line), read back and compacted at
recovery (records_store.py owns the file; this module owns the rules).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class ReclaimedIds:
    """Deleted session ids and when (wall-clock seconds), bounded in count and age."""

    def __init__(self, limit: int, ttl: float) -> None:
        self.limit = limit
        self.ttl = ttl
        self._ids: OrderedDict[str, float] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.limit > 0 and self.ttl > 0

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, session_id: str, when: float) -> None:
        if not self.enabled:
            return
        self._ids[session_id] = when
        self._ids.move_to_end(session_id)
        while len(self._ids) > self.limit:
            self._ids.popitem(last=False)

    def load(self, entries: Iterable[tuple[str, float]], now: float) -> None:
        """Tombstones read back from the records directory, oldest first."""
        for session_id, when in entries:
            if now - when < self.ttl:
                self.add(session_id, when)

    def discard(self, session_id: str) -> None:
        """The id names a live session again (created anew on purpose)."""
        self._ids.pop(session_id, None)

    def age(self, session_id: str, now: float) -> float | None:
        """Seconds since `session_id` was deleted, or None when it is not a tombstone (never
        deleted, or deleted longer than `ttl` ago: forgotten now)."""
        self._expire(now)
        when = self._ids.get(session_id)
        return None if when is None else max(0.0, now - when)

    def entries(self, now: float) -> list[tuple[str, float]]:
        """The live tombstones, oldest first (what a compaction writes back)."""
        self._expire(now)
        return list(self._ids.items())

    def _expire(self, now: float) -> None:
        # Deletion times only grow along the order (clock steps aside), so the old ones lead.
        while self._ids:
            session_id, when = next(iter(self._ids.items()))
            if now - when < self.ttl:
                break
            del self._ids[session_id]

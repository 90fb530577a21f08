"""Sticky keys: smg 1.13's `--sticky-sessions` over any policy but manual and
consistent_hashing (which route on their own key already).

A request's sticky key is its body's `rid` (a string) with one trailing `_r<n>` (a retry)
and then one trailing `_t<n>` (a turn) stripped, so `conv_t2_r1`, `conv_t3` and `conv` share
the key `conv`; a rid that is nothing but suffixes keys as itself. Without a rid, the first
of `routing_key_headers` the request carries (each name's first header) gives the key,
stripped alike, when its value is valid: non-empty UTF-8 of at most 128 bytes. A key over
128 bytes is no key.

A keyed request goes to the engine its key is pinned to, while that engine is a candidate and
the key has fewer than two of its own requests in flight there; the policy then learns the
request as sent there (`record`), as for a session family's turn. A key with two in flight on
its engine spills: the policy picks, and the pin moves only when the pick is another engine
where the key has fewer than two in flight (so pressure cannot walk a key off the engine
holding its prefix). A new key, or one whose engine is no longer a candidate, goes where the
policy picks and is pinned there. Requests without a key are the policy's.

Pins unused for `max_idle_secs` are forgotten at the next `evict`; a pin's last use is known
to the resolution of the eviction interval, as manual's keys are. Requests count in flight
per key only when the caller says which key started and finished (`EnginePolicy.started`,
`.finished`); the compiled front and the pool do.
"""

from __future__ import annotations

from collections.abc import Sequence

from sessiongate.config.engines import OWN_KEY_POLICIES
from sessiongate.engines.policy.base import EngineStates, Policy, RoutingRequest

MAX_KEY_BYTES = 128
IN_FLIGHT_CAP = 2
__all__ = ["OWN_KEY_POLICIES", "StickyKeys", "sticky_key", "strip_lineage"]


def _strip_tag(key: str, tag: str) -> str:
    head, sep, tail = key.rpartition("_")
    digits = tail[1:]
    if sep and tail[:1] == tag and digits and digits.isascii() and digits.isdigit():
        return head
    return key


def strip_lineage(key: str) -> str:
    """`conv_t2_r1` -> `conv`: one `_r<n>`, then one `_t<n>`; all suffix keys as itself."""
    stripped = _strip_tag(_strip_tag(key, "r"), "t")
    return stripped or key


def _valid(key: str) -> bool:
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate: not UTF-8
        return False
    return 0 < size <= MAX_KEY_BYTES


def sticky_key(request: RoutingRequest, header_names: Sequence[str]) -> str | None:
    """The request's sticky key, None when it has none."""
    rid = request.material.rid
    if rid is not None:
        key = strip_lineage(rid)
        return key if _valid(key) else None
    for name in header_names:
        value = request.header(name)
        if value is not None and _valid(value):
            return strip_lineage(value)
    return None


class Pin:
    __slots__ = ("engine", "last_used")

    def __init__(self, engine: int, now: float) -> None:
        self.engine = engine
        self.last_used = now


class StickyKeys:
    """The pins and the per-key requests in flight, over one policy."""

    def __init__(self, header_names: Sequence[str], max_idle_secs: int) -> None:
        self.header_names = [name.lower() for name in header_names]
        self.max_idle = max_idle_secs
        self.pins: dict[str, Pin] = {}
        self.in_flight: dict[tuple[str, int], int] = {}
        self.now = 0.0

    def _count(self, key: str, engine: int) -> int:
        return self.in_flight.get((key, engine), 0)

    def pick(
        self, request: RoutingRequest, engines: EngineStates, policy: Policy
    ) -> tuple[int, str | None]:
        """The engine for `request` and its sticky key (None: the policy's pick)."""
        key = sticky_key(request, self.header_names)
        if key is None:
            return policy.pick(request, engines), None
        pin = self.pins.get(key)
        if pin is not None and pin.engine in engines.candidates():
            pin.last_used = self.now
            if self._count(key, pin.engine) < IN_FLIGHT_CAP:
                record = getattr(policy, "record", None)
                if record is not None:
                    record(pin.engine, request, engines)
                return pin.engine, key
            chosen = policy.pick(request, engines)
            if chosen != pin.engine and self._count(key, chosen) < IN_FLIGHT_CAP:
                pin.engine = chosen
            return chosen, key
        chosen = policy.pick(request, engines)
        self.pins[key] = Pin(chosen, self.now)
        return chosen, key

    def started(self, key: str, engine: int) -> None:
        slot = (key, engine)
        self.in_flight[slot] = self.in_flight.get(slot, 0) + 1

    def finished(self, key: str, engine: int) -> None:
        slot = (key, engine)
        left = self.in_flight.get(slot, 0) - 1
        if left > 0:
            self.in_flight[slot] = left
        else:
            self.in_flight.pop(slot, None)

    def evict(self, now: float) -> None:
        self.now = now
        if self.max_idle <= 0:
            return
        idle = [k for k, pin in self.pins.items() if now - pin.last_used >= self.max_idle]
        for key in idle:
            del self.pins[key]

"""manual: sticky routing by the `X-SMG-Routing-Key` header, as the Gateway's.

A key seen for the first time goes where `assignment_mode` says (`random`; `min_load`: fewest
requests in flight; `min_group`: fewest keys assigned; ties at random) and stays there. Each
key remembers its last two engines: while either is healthy (the older one first) the key
goes there, else to a new one chosen as for a new key. A request without the key goes to a
random candidate. Keys unused for `max_idle_secs` are forgotten at the next `evict`; a key's
last use is known to the resolution of the eviction interval (the time of the last `evict`).
"""

from __future__ import annotations

from sessiongate.config.engines import EngineRoutingConfig
from sessiongate.engines.policy.base import (
    ROUTING_KEY_HEADER,
    EngineStates,
    Rng,
    RoutingRequest,
    least,
)

MAX_CANDIDATES = 2


class Assignment:
    __slots__ = ("engines", "last_used")

    def __init__(self, engine: int, now: float) -> None:
        self.engines = [engine]
        self.last_used = now


class Manual:
    name = "manual"

    def __init__(self, config: EngineRoutingConfig, engines: int, seed: int) -> None:
        self.mode = config.assignment_mode
        self.max_idle = config.max_idle_secs
        self.rng = Rng(seed)
        self.keys: dict[str, Assignment] = {}
        # Keys whose latest engine is each engine (min_group's measure).
        self.groups = [0] * engines
        self.now = 0.0

    def _new_engine(self, candidates: list[int], engines: EngineStates) -> int:
        if self.mode == "random":
            return candidates[self.rng.below(len(candidates))]
        measure = engines.in_flight if self.mode == "min_load" else self.groups
        tied = least(candidates, measure)
        return tied[self.rng.below(len(tied))] if len(tied) > 1 else tied[0]

    def pick(self, request: RoutingRequest, engines: EngineStates) -> int:
        candidates = engines.candidates()
        key = request.header(ROUTING_KEY_HEADER)
        if key is None:
            return candidates[self.rng.below(len(candidates))]
        assignment = self.keys.get(key)
        if assignment is None:
            engine = self._new_engine(candidates, engines)
            self.keys[key] = Assignment(engine, self.now)
            self.groups[engine] += 1
            return engine
        assignment.last_used = self.now
        for engine in assignment.engines:
            if engine in candidates:
                return engine
        engine = self._new_engine(candidates, engines)
        self.groups[assignment.engines[-1]] -= 1
        if len(assignment.engines) >= MAX_CANDIDATES:
            del assignment.engines[0]
        assignment.engines.append(engine)
        self.groups[engine] += 1
        return engine

    def evict(self, now: float) -> None:
        self.now = now
        if self.max_idle <= 0:
            return
        idle = [k for k, a in self.keys.items() if now - a.last_used >= self.max_idle]
        for key in idle:
            self.groups[self.keys.pop(key).engines[-1]] -= 1

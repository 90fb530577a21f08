"""round_robin: the candidates in turn (the front's behaviour before policies existed)."""

from __future__ import annotations

from sessiongate.engines.policy.base import EngineStates, RoutingRequest


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self.turn = 0

    def pick(self, request: RoutingRequest, engines: EngineStates) -> int:
        candidates = engines.candidates()
        turn, self.turn = self.turn, self.turn + 1
        return candidates[turn % len(candidates)]

    def evict(self, now: float) -> None:
        pass

"""least_in_flight: the candidate with the fewest requests in flight through this gateway,
the rule of the rollout framework's own router (miles `MilesRouter._use_url`). Ties go to the
lowest index, as there, or (`tie_break="round_robin"`) to the tied engines in turn."""

from __future__ import annotations

from sessiongate.engines.policy.base import EngineStates, RoutingRequest, least


class LeastInFlight:
    name = "least_in_flight"

    def __init__(self, tie_break: str) -> None:
        self.rotate = tie_break == "round_robin"
        self.turn = 0

    def pick(self, request: RoutingRequest, engines: EngineStates) -> int:
        tied = least(engines.candidates(), engines.in_flight)
        if not self.rotate:
            return tied[0]
        turn, self.turn = self.turn, self.turn + 1
        return tied[turn % len(tied)]

    def evict(self, now: float) -> None:
        pass

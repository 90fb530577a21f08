"""power_of_two: two distinct random candidates, the less loaded of them (the first drawn on
a tie). Load is what the engine's `/get_load` last reported, else its requests in flight."""

from __future__ import annotations

from sessiongate.engines.policy.base import EngineStates, Rng, RoutingRequest


class PowerOfTwo:
    name = "power_of_two"

    def __init__(self, seed: int) -> None:
        self.rng = Rng(seed)

    def pick(self, request: RoutingRequest, engines: EngineStates) -> int:
        candidates = engines.candidates()
        n = len(candidates)
        if n == 1:
            return candidates[0]
        first = self.rng.below(n)
        second = self.rng.below(n - 1)
        if second >= first:
            second += 1
        a, b = candidates[first], candidates[second]
        return a if engines.reported_load(a) <= engines.reported_load(b) else b

    def evict(self, now: float) -> None:
        pass

"""random: a uniformly random candidate."""

from __future__ import annotations

from sessiongate.engines.policy.base import EngineStates, Rng, RoutingRequest


class RandomPick:
    name = "random"

    def __init__(self, seed: int) -> None:
        self.rng = Rng(seed)

    def pick(self, request: RoutingRequest, engines: EngineStates) -> int:
        candidates = engines.candidates()
        return candidates[self.rng.below(len(candidates))]

    def evict(self, now: float) -> None:
        pass

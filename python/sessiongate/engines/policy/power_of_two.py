"""power_of_two: two distinct random candidates, the less loaded of them (the first drawn on
a tie). What "loaded" means is `power_of_two_load_metric` (smg 1.13's
`--power-of-two-load-metric`):

- `expected_wait` (default): least_load's score (`least_load.ExpectedWait`) once either of
  the two has a `/v1/loads` report, the winner credited as least_load credits it; while
  neither has one, as before loads were polled: the engine's `/get_load` when set, else its
  requests in flight.
- `requests`: the report's running plus waiting requests plus requests sent since it, else
  the `/get_load` figure, else requests in flight.
- `least_requests`: requests in flight through this process.
"""

from __future__ import annotations

from sessiongate.config.engines import EngineRoutingConfig
from sessiongate.engines.policy.base import EngineStates, Rng, RoutingRequest
from sessiongate.engines.policy.least_load import ExpectedWait


class PowerOfTwo:
    name = "power_of_two"

    def __init__(self, config: EngineRoutingConfig, seed: int) -> None:
        self.rng = Rng(seed)
        self.metric = config.power_of_two_load_metric
        self.scorer = ExpectedWait(config)

    def _requests(self, engines: EngineStates, index: int) -> int:
        report = engines.loads[index]
        if report is None:
            return engines.reported_load(index)
        return report.running_reqs + report.waiting_reqs + engines.since_reqs[index]

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
        if self.metric == "least_requests":
            return a if engines.in_flight[a] <= engines.in_flight[b] else b
        if self.metric == "expected_wait":
            if engines.loads[a] is None and engines.loads[b] is None:
                return a if engines.reported_load(a) <= engines.reported_load(b) else b
            wait_a, wait_b = self.scorer.scores(engines, (a, b))
            best = a if wait_a <= wait_b else b
            self.scorer.credit(engines, best, request)
            return best
        best = a if self._requests(engines, a) <= self._requests(engines, b) else b
        self.scorer.credit(engines, best, None)
        return best

    def record(self, index: int, request: RoutingRequest, engines: EngineStates) -> None:
        if self.metric == "expected_wait":
            self.scorer.credit(engines, index, request)
        elif self.metric == "requests":
            self.scorer.credit(engines, index, None)

    def evict(self, now: float) -> None:
        pass

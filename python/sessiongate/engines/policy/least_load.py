"""least_load: the candidate of lowest expected wait, smg 1.13's rule
(`model_gateway/src/policies/least_load.rs`), from what the engines' `GET /v1/loads` said:

    wait(engine) = (queued tokens + tokens sent since its report) / throughput
                   + kv_pressure_weight x k / (1 - k)

where "queued tokens" is the report's `num_waiting_uncached_tokens` (else its waiting
requests x `mean_prefill_tokens`), "throughput" its `gen_throughput` (else
`default_throughput`), k its KV `token_usage` (clamped to [0, 0.999]). A request adds its
token ids' count to the engine it goes to, `mean_prefill_tokens` without ids, until the
engine's next report: polls are seconds apart, and without the credit one interval's
requests would all go to the engine that looked idlest at the poll.

An engine without a report while others have one is scored on its requests in flight x
`mean_prefill_tokens` / the reporting candidates' mean throughput (its drain time, in the
same unit); with no report at all the score is the requests in flight (join the shortest
queue). Ties go to one of the tied at random (reservoir sampling on the policy's generator,
as smg, so equal idle engines share the traffic). `max_waiting_requests` > 0 leaves out
engines whose reported waiting requests plus requests sent since reach it, unless every
candidate does (smg then queues the request in its admission queue; here the score decides
among all).

`ExpectedWait` is the score; power_of_two compares its two engines with it.
"""

from __future__ import annotations

from collections.abc import Sequence

from sessiongate.config.engines import EngineRoutingConfig
from sessiongate.engines.policy.base import EngineStates, LoadReport, Rng, RoutingRequest

# The KV usage the barrier is clamped to: k/(1-k) would be infinite at 1.
MAX_TOKEN_USAGE = 0.999


class ExpectedWait:
    """The expected-wait score (seconds; lower is better) and the since-report credit."""

    def __init__(self, config: EngineRoutingConfig) -> None:
        self.kv_weight = float(config.least_load_kv_pressure_weight)
        self.default_throughput = float(config.least_load_default_throughput)
        self.mean_prefill = config.least_load_mean_prefill_tokens

    def queued_tokens(self, report: LoadReport) -> int:
        if report.waiting_tokens > 0:
            return report.waiting_tokens
        # An engine that reports a queue but not its tokens is not idle.
        return report.waiting_reqs * self.mean_prefill

    def scores(self, engines: EngineStates, candidates: Sequence[int]) -> list[float]:
        """The score of each candidate, in candidate order."""
        loads = engines.loads
        rates = [r.throughput for i in candidates if (r := loads[i]) is not None]
        if not rates:
            return [float(engines.in_flight[i]) for i in candidates]
        positive = [t for t in rates if t > 0]
        nominal = sum(positive) / len(positive) if positive else self.default_throughput
        out = []
        for i in candidates:
            report = loads[i]
            if report is None:
                out.append(engines.in_flight[i] * self.mean_prefill / nominal)
                continue
            rate = report.throughput if report.throughput > 0 else self.default_throughput
            k = min(max(report.token_usage, 0.0), MAX_TOKEN_USAGE)
            work = self.queued_tokens(report) + engines.since_tokens[i]
            out.append(work / rate + self.kv_weight * k / (1.0 - k))
        return out

    def credit(self, engines: EngineStates, index: int, request: RoutingRequest | None) -> None:
        """`request` went to `index`: count it until the engine's next report (only while
        the engine has one: the next report resets the count anyway). Without a request
        (power_of_two comparing requests) only the request count moves."""
        if engines.loads[index] is None:
            return
        engines.since_reqs[index] += 1
        if request is not None:
            ids = request.material.ids
            engines.since_tokens[index] += len(ids) if ids else self.mean_prefill


class LeastLoad:
    name = "least_load"

    def __init__(self, config: EngineRoutingConfig, seed: int) -> None:
        self.scorer = ExpectedWait(config)
        self.cap = config.least_load_max_waiting_requests
        self.rng = Rng(seed)

    def _eligible(self, engines: EngineStates) -> list[int]:
        candidates = engines.candidates()
        if self.cap == 0:
            return candidates
        loads, since = engines.loads, engines.since_reqs
        under = [
            i for i in candidates if (r := loads[i]) is None or r.waiting_reqs + since[i] < self.cap
        ]
        return under or candidates

    def pick(self, request: RoutingRequest, engines: EngineStates) -> int:
        candidates = self._eligible(engines)
        scores = self.scorer.scores(engines, candidates)
        best, best_score, tied = candidates[0], scores[0], 1
        for index, score in zip(candidates[1:], scores[1:], strict=True):
            if score < best_score:
                best, best_score, tied = index, score, 1
            elif score == best_score:
                # Keep each tied candidate with probability 1/tied: uniform over the ties.
                tied += 1
                if self.rng.below(tied) == 0:
                    best = index
        self.scorer.credit(engines, best, request)
        return best

    def record(self, index: int, request: RoutingRequest, engines: EngineStates) -> None:
        self.scorer.credit(engines, index, request)

    def evict(self, now: float) -> None:
        pass

"""`EnginePolicy`: a policy and the engine states it decides on, as the callers drive it.

The pure-Python twin of `sessiongate._core.EnginePolicy` (`rust/engine_policy/`): same
constructor, same methods, same picks for the same calls. The caller reports what the
policy cannot see: a request sent (`started`) and done (`finished`), an engine's health, its
reported load (`set_load`: a `/get_load` figure; `set_loads`: what `GET /v1/loads` said, a
`LoadReport` of the figures summed over the engine's DP ranks, or None once it is unknown or
too old), and the time for `evict`.

With `sticky_sessions`, picks go through the sticky keys first (`sticky.py`); `pick_keyed`
answers the key too, and the caller passes it to `started` and `finished` so that the key's
requests in flight are counted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sessiongate.config.engines import EngineRoutingConfig
from sessiongate.engines.policy.base import EngineStates, LoadReport, RoutingRequest
from sessiongate.engines.policy.cache_aware import CacheAware
from sessiongate.engines.policy.factory import make_policy
from sessiongate.engines.policy.least_load import LeastLoad
from sessiongate.engines.policy.power_of_two import PowerOfTwo
from sessiongate.engines.policy.sticky import StickyKeys, sticky_key


class EnginePolicy:
    def __init__(
        self,
        name: str,
        engines: Sequence[str],
        options: Mapping[str, object] | None = None,
    ) -> None:
        if not engines:
            raise ValueError("at least one engine URL is needed")
        try:
            config = EngineRoutingConfig(policy=name, **dict(options or {}))  # type: ignore[arg-type]
        except TypeError as exc:
            raise ValueError(f"bad engine routing options: {exc}") from None
        self.config = config
        self.engines = EngineStates(engines)
        if config.worker_overload_protection:
            self.engines.overload = (
                config.worker_overload_waiting_requests,
                config.worker_overload_token_usage,
            )
        self.policy = make_policy(config, len(engines))
        self.sticky = (
            StickyKeys(config.routing_key_headers, config.max_idle_secs) if config.sticks else None
        )

    @property
    def name(self) -> str:
        return self.config.policy

    @property
    def in_flight(self) -> list[int]:
        return list(self.engines.in_flight)

    def _check(self, index: int) -> None:
        if not 0 <= index < len(self.engines):
            raise IndexError(f"engine index {index} out of range (0..{len(self.engines) - 1})")

    def pick(self, headers: Sequence[tuple[str, str]], body: bytes) -> int:
        """The engine for a request with these headers and body."""
        return self.pick_keyed(headers, body)[0]

    def pick_keyed(self, headers: Sequence[tuple[str, str]], body: bytes) -> tuple[int, str | None]:
        """The engine for a request and its sticky key (None without sticky sessions or
        without a key): pass the key to `started` and `finished`."""
        request = RoutingRequest(headers, body)
        if self.sticky is None:
            return self.policy.pick(request, self.engines), None
        return self.sticky.pick(request, self.engines, self.policy)

    def sticky_key(self, headers: Sequence[tuple[str, str]], body: bytes) -> str | None:
        """The request's sticky key (what `pick_keyed` answers with the engine), None without
        sticky sessions or without a key."""
        if self.sticky is None:
            return None
        return sticky_key(RoutingRequest(headers, body), self.sticky.header_names)

    def record(self, index: int, headers: Sequence[tuple[str, str]], body: bytes) -> None:
        """A request with these headers and body went to engine `index` without a pick (a
        pinned session family's turn): the policy learns it as a pick of `index` would
        (cache_aware keeps its prefix tree and work estimate; least_load and power_of_two
        count it as sent since the engine's load report)."""
        self._check(index)
        if isinstance(self.policy, CacheAware | LeastLoad | PowerOfTwo):
            self.policy.record(index, RoutingRequest(headers, body), self.engines)

    def prefilled(self, index: int, headers: Sequence[tuple[str, str]], body: bytes) -> None:
        """Engine `index` answered this request (a 200): its prompt is in the engine's cache
        (cache_aware counts a sent prefix as held from then on; other policies ignore it)."""
        self._check(index)
        if isinstance(self.policy, CacheAware):
            self.policy.prefilled(index, RoutingRequest(headers, body))

    def held(self, index: int, headers: Sequence[tuple[str, str]], body: bytes) -> int | None:
        """Units of this request's prompt engine `index` is believed to hold, asked at the
        pick and handed back to `cached` with the reply's `cached_tokens`; None when the
        policy learns nothing from replies (all but cache_aware on token ids)."""
        self._check(index)
        if isinstance(self.policy, CacheAware):
            return self.policy.held(index, RoutingRequest(headers, body))
        return None

    def cached(
        self,
        index: int,
        headers: Sequence[tuple[str, str]],
        body: bytes,
        held: int,
        cached_tokens: int,
    ) -> int:
        """Engine `index` answered this request with `cached_tokens` of its prompt from its
        cache, where `held` said `held` at the pick (cache_aware drops what the engine
        lost; call it before `prefilled`). The units the engine is learned to have lost
        (0: none, or within the slack)."""
        self._check(index)
        for name, value in (("held", held), ("cached_tokens", cached_tokens)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if isinstance(self.policy, CacheAware):
            return self.policy.cached(index, RoutingRequest(headers, body), held, cached_tokens)
        return 0

    def started(self, index: int, key: str | None = None) -> None:
        """A request is sent to `index` (`key`: its sticky key from `pick_keyed`)."""
        self._check(index)
        self.engines.in_flight[index] += 1
        if key is not None and self.sticky is not None:
            self.sticky.started(key, index)

    def finished(
        self, index: int, cached_tokens: int | None = None, key: str | None = None
    ) -> None:
        """A request on `index` is done (`key`: the sticky key it started with).
        `cached_tokens` is accepted and not read here: a reply's cached_tokens reaches the
        policy through `cached`, against the belief `held` gave at the pick."""
        self._check(index)
        if key is not None and self.sticky is not None:
            self.sticky.finished(key, index)
        engines = self.engines
        running = engines.in_flight[index]
        # Which request ended is not known: take off the engine's mean work per request,
        # and nothing is left once nothing is in flight (estimates never pile up).
        engines.work[index] = (
            engines.work[index] - engines.work[index] // running if running > 1 else 0
        )
        engines.in_flight[index] = max(0, running - 1)

    def set_load(self, index: int, load: int | None) -> None:
        """The engine's reported load (`/get_load`), None when unknown."""
        self._check(index)
        if load is not None and load < 0:
            raise ValueError(f"load must be >= 0, got {load}")
        self.engines.load[index] = load

    def set_loads(
        self, index: int, report: LoadReport | tuple[int, int, int, float, float] | None
    ) -> None:
        """What the engine's `GET /v1/loads` said (`LoadReport`: running requests, waiting
        requests, waiting uncached tokens, mean KV token usage, generation throughput),
        None when unknown or aged out. A report resets the tokens and requests counted as
        sent to the engine since the previous one."""
        self._check(index)
        if report is None:
            self.engines.loads[index] = None
            return
        if not isinstance(report, tuple) or len(report) != 5:
            raise ValueError(f"a load report is 5 numbers, got {report!r}")
        running, waiting, tokens, usage, rate = report
        # Floats as floats: an integer throughput must divide as the compiled twin's f64.
        checked = LoadReport(
            running,
            waiting,
            tokens,
            float(usage) if type(usage) is int else usage,
            float(rate) if type(rate) is int else rate,
        )
        problem = checked.problem()
        if problem is not None:
            raise ValueError(problem)
        self.engines.loads[index] = checked
        self.engines.since_tokens[index] = 0
        self.engines.since_reqs[index] = 0

    def set_healthy(self, index: int, healthy: bool) -> None:
        self._check(index)
        self.engines.healthy[index] = bool(healthy)

    def evict(self, now: float) -> None:
        """Trim the policy's state (`now`: seconds on a monotonic clock)."""
        self.policy.evict(now)
        if self.sticky is not None:
            self.sticky.evict(now)

"""Several upstreams with session-family affinity.

Each session family (a root session and its sub-agents) is pinned to one upstream for its
life, so a family shares one replica and its prefix cache. Where it is pinned is decided
when the family makes its first upstream call: by the engine routing policy (`--policy`),
from that call's headers and body, so cache_aware places a family where its prompt's prefix
is cached (cache_aware is the default) and least_in_flight on the least busy engine; with
round_robin by rendezvous (highest random weight) hashing of its root id over the healthy
upstreams, the placement before policies existed, stable across processes and restarts
(docs/routing.md, "Session families"). Upstreams are probed periodically; a connection
failure (nothing sent) marks the upstream down, re-pins the family off it (the policy's
pick among the others, or the next upstream in its rendezvous order) and retries the
request once.

Stateless requests (no family) go where the engine routing policy says (`--policy`,
`sessiongate.engines.policy`; `cache_aware` over the available upstreams by default), which
is told every request's start and end (a family's turns too) and each upstream's
availability: healthy, and its circuit breaker not open.

Retries (`--retry-*`, docs/reliability.md "Engine-facing retries and the circuit breaker"):
a request is sent again, after a backoff, only when nothing was sent (the connection could
not be made) or the engine refused it before doing any work (429, 503); a stream is retried
only on its reply head, before anything reached the client. A family stays on its engine
unless that engine is down or its breaker open; a stateless retry is the policy's pick again.

The engine set may change at run time (`set_urls`, fed by the engine registry): kept engines
keep their client and health, families pinned to a removed one re-pin on their next turn,
and a request in flight on a removed engine finishes on the client it holds. The set may be
empty (engines not registered yet): every request then fails with 503.

The health state is also what `/health` and `/metrics` report, so it is kept with one
upstream too: the probe runs whatever the count, a transport failure of a real request marks
the upstream down at once and any reply (below 500) marks it up again; probes flip it only
after `--health-failure-threshold` failures or `--health-success-threshold` passes in a row.
The probes are the pool's own health loop in a worker process; where the engine registry
lives in the same process (`serve --workers 0`), its prober feeds the pool instead
(`fed_by`), so each engine is probed once per process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TypeVar

from sessiongate.config.rl import DEFAULT_PAUSE_QUEUE, DEFAULT_PAUSE_WAIT_S
from sessiongate.engines.client import (
    EngineClient,
    EngineReply,
    EngineStream,
    EngineTransportError,
    EngineUnreachable,
)
from sessiongate.engines.hold import HoldGate
from sessiongate.engines.loads import LoadPoll, LoadSink
from sessiongate.engines.policy import EnginePolicy, EngineRoutingConfig
from sessiongate.engines.policy.base import LoadReport
from sessiongate.engines.registry import HealthSink, same_engine
from sessiongate.engines.reliability import (
    OPEN,
    RETRYABLE_STATUSES,
    STATE_NAMES,
    CircuitBreaker,
    HealthCounter,
    ReliabilityConfig,
    backoff_ms,
    new_breaker,
)
from sessiongate.engines.siblings import GENERATE_PATH, Key, Siblings
from sessiongate.errors import Unavailable
from sessiongate.hashing import rendezvous_weight
from sessiongate.primitives import CachedTokensWatch

logger = logging.getLogger(__name__)

NO_ENGINE = "no engine registered yet"
# The policies under which a family is placed by rendezvous hashing of its root id, not by
# the policy: round robin reads nothing of the request, so it would place families no
# better, and rendezvous keeps a family on one engine across worker processes and restarts.
RENDEZVOUS_PLACEMENT = frozenset({"round_robin"})

Sent = TypeVar("Sent", EngineReply, EngineStream)


def rendezvous_order(key: str, urls: Sequence[str]) -> list[int]:
    """Indices of `urls` from most to least preferred for `key` (stable across processes)."""

    raw = key.encode()
    return sorted(range(len(urls)), key=lambda i: rendezvous_weight(raw, urls[i]), reverse=True)


def retry_target(order: Sequence[int], failed: int, available: Sequence[bool]) -> int | None:
    """Where a stateless request goes after engine `failed` could not be connected to: the
    first engine of `order` (the rendezvous order of the empty key) other than `failed` that
    is available, else the first other one; None with a single engine. Twinned by
    `rust/front/failure.rs`, so both fronts retry on the same engine."""
    if len(order) <= 1:
        return None
    others = [index for index in order if index != failed]
    return next((index for index in others if available[index]), others[0] if others else None)


class NoEngine:
    """The engine policy of an empty engine set (`--backend none` before a registration):
    nothing to pick, nothing to count (the Rust policy needs at least one engine)."""

    @property
    def in_flight(self) -> list[int]:
        return []

    def pick(self, headers: list[tuple[str, str]], body: bytes) -> int:
        raise Unavailable(NO_ENGINE)

    def record(self, index: int, headers: list[tuple[str, str]], body: bytes) -> None:
        pass

    def prefilled(self, index: int, headers: list[tuple[str, str]], body: bytes) -> None:
        pass

    def held(self, index: int, headers: list[tuple[str, str]], body: bytes) -> int | None:
        return None

    def cached(
        self, index: int, headers: list[tuple[str, str]], body: bytes, held: int, cached: int
    ) -> int:
        return 0

    def pick_keyed(self, headers: list[tuple[str, str]], body: bytes) -> tuple[int, str | None]:
        raise Unavailable(NO_ENGINE)

    def sticky_key(self, headers: list[tuple[str, str]], body: bytes) -> str | None:
        return None

    def started(self, index: int, key: str | None = None) -> None:
        pass

    def finished(
        self, index: int, cached_tokens: int | None = None, key: str | None = None
    ) -> None:
        pass

    def set_healthy(self, index: int, healthy: bool) -> None:
        pass

    def set_loads(self, index: int, report: LoadReport | None) -> None:
        pass

    def evict(self, now: float) -> None:
        pass


class EnginePool:
    def __init__(
        self,
        urls: Sequence[str],
        *,
        timeout: float = 600.0,
        health_interval: float = 5.0,
        health_path: str | None = None,
        engine_routing: EngineRoutingConfig | None = None,
        allow_empty: bool = False,
        reliability: ReliabilityConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        pause_queue_size: int = DEFAULT_PAUSE_QUEUE,
        pause_wait_secs: float = DEFAULT_PAUSE_WAIT_S,
    ) -> None:
        if not urls and not allow_empty:
            raise ValueError("at least one upstream URL is needed")
        self.timeout = timeout
        # Clients of engines removed by `set_urls`, closed with the pool: a request in flight
        # on one still holds it (the drain).
        self._retired: list[EngineClient] = []
        self.urls = [u.rstrip("/") for u in urls]
        if len(set(self.urls)) != len(self.urls):
            raise ValueError(f"upstream URLs must be distinct: {self.urls}")
        self.clients = [EngineClient(u, timeout=timeout) for u in self.urls]
        # Assumed up until a probe or a request says otherwise, so a gateway started next to
        # its engine is not reported down for its first health interval.
        self.healthy = [True] * len(self.urls)
        # Why each upstream was last marked down (kept until it is up again).
        self.last_error: list[str | None] = [None] * len(self.urls)
        self.pins: dict[str, int] = {}
        self.affinity_hits = 0
        self.repins = 0
        # Requests sent to each engine (every attempt, retries included), by URL so a
        # change of the engine set keeps the kept engines' counts: /metrics' per-engine
        # counter.
        self.sent: Counter[str] = Counter()
        # Prompt tokens each engine was believed to hold and had lost, as replies'
        # cached_tokens showed (cache_aware on token ids), by URL as `sent`.
        self.lost: Counter[str] = Counter()
        self.health_interval = health_interval
        self.reliability = reliability or ReliabilityConfig()
        self.health_path = health_path or self.reliability.health_check_endpoint
        # The breakers' clock (a test's fake one).
        self.clock = clock
        self.breakers = [new_breaker(self.reliability) for _ in self.urls]
        self.probes = [self._health_counter() for _ in self.urls]
        # Retries caused by each engine (its connect error, 429 or 503), for /metrics.
        self.retries = [0] * len(self.urls)
        # Engines whose breaker is open: checked on each pick for their timeout.
        self._open: set[int] = set()
        self.engine_routing = engine_routing or EngineRoutingConfig()
        # Engines that take no new request (paused, or behind on weights): engines/hold.py.
        self.hold = HoldGate(pause_queue_size, pause_wait_secs)
        # Requests with one prompt on one engine, prefilled there once: engines/siblings.py.
        self.siblings = Siblings(self.engine_routing.hold_siblings)
        self.engine_policy = self._policy_for(self.urls)
        # Whether a family's first call is placed by the policy (else by rendezvous).
        self.places_by_policy = self.engine_routing.policy not in RENDEZVOUS_PLACEMENT
        self._prober: asyncio.Task[None] | None = None
        # True once another prober of this process feeds `probed` (`fed_by`): no health
        # loop of its own then.
        self._fed = False
        self._evictor: asyncio.Task[None] | None = None
        # The `GET /v1/loads` poll of a pool that reads loads and is not fed them (a
        # worker's: engines/loads.py).
        self._loads_fed = False
        self._load_poll: LoadPoll | None = None
        # GET /model_info per upstream, once it answered: its JSON object, or {} when it
        # answered with none (an engine that is not SGLang).
        self._model_info: list[dict[str, object] | None] = [None] * len(self.urls)

    def _health_counter(self) -> HealthCounter:
        return HealthCounter(
            self.reliability.health_failure_threshold, self.reliability.health_success_threshold
        )

    def _policy_for(self, urls: Sequence[str]) -> EnginePolicy | NoEngine:
        if not urls:
            return NoEngine()
        return EnginePolicy(self.engine_routing.policy, list(urls), self.engine_routing.options())

    @property
    def base_url(self) -> str:
        return ",".join(self.urls)

    def start(self) -> None:
        """Start periodic health checks (idempotent; needs a running loop). With one upstream
        they steer nothing, but they are what `/health` reports about the engine."""
        if self._prober is None and not self._fed:
            self._prober = asyncio.create_task(self._probe_forever())
        if self._evictor is None and self.engine_routing.evicts:
            self._evictor = asyncio.create_task(self._evict_forever())
        if self._load_poll is None and self.engine_routing.reads_loads and not self._loads_fed:
            self._load_poll = LoadPoll(
                lambda: list(self.urls),
                self.engine_routing.load_monitor_interval,
                self.reliability.health_check_timeout_secs,
            )
            self._load_poll.feed(self.loads_probed)
            self._load_poll.start()

    async def _evict_forever(self) -> None:
        while True:
            await asyncio.sleep(self.engine_routing.eviction_interval_secs)
            self.engine_policy.evict(time.monotonic())

    async def _probe_forever(self) -> None:
        while True:
            clients = list(self.clients)
            timeout = self.reliability.health_check_timeout_secs
            results = await asyncio.gather(
                *(c.check(self.health_path, timeout) for c in clients), return_exceptions=True
            )
            for client, result in zip(clients, results, strict=True):
                # The set may have changed during the probe: results go by client.
                index = self._index_of(client)
                if index is None:
                    continue
                if isinstance(result, BaseException):
                    result = f"health probe failed: {type(result).__name__}: {result}"
                self._probed(index, result)
            await asyncio.sleep(self.health_interval)

    def fed_by(self, feed: Callable[[HealthSink], None]) -> None:
        """Take the health verdicts of this process's one prober (`EngineRegistry.feed`)
        instead of probing: call before `start`."""
        self._fed = True
        feed(self.probed)

    def fed_loads_by(self, feed: Callable[[LoadSink], None]) -> None:
        """Take the load reports of this process's one load poll
        (`EngineRegistry.feed_loads`) instead of polling: call before `start`."""
        self._loads_fed = True
        feed(self.loads_probed)

    def loads_probed(self, url: str, report: LoadReport | None) -> None:
        """A `/v1/loads` poll's outcome for the engine at `url` (None: no report), for the
        policy; ignored when it is not in this set."""
        for index, mine in enumerate(self.urls):
            if same_engine(mine, url):
                self.engine_policy.set_loads(index, report)
                return

    def probed(self, url: str, error: str | None) -> None:
        """A probe's verdict on the engine at `url` (None: healthy); ignored when it is not
        in this set (the URL as the registry normalises it)."""
        for index, mine in enumerate(self.urls):
            if same_engine(mine, url):
                self._probed(index, error)
                return

    def _probed(self, index: int, error: str | None) -> None:
        """One probe's verdict, which flips the engine's health only at its threshold."""
        healthy = self.healthy[index]
        up = self.probes[index].probe(error is None, healthy)
        if up != healthy:
            self._mark(index, error, from_probe=True)
        elif error is not None and not up:
            self.last_error[index] = error  # still down: the latest reason
        elif error is None and up:
            self.last_error[index] = None

    def _index_of(self, client: EngineClient) -> int | None:
        """Where `client` is in the current set; None once its engine was removed."""
        for index, current in enumerate(self.clients):
            if current is client:
                return index
        return None

    def set_urls(self, urls: Sequence[str], held: Sequence[str] = ()) -> None:
        """Replace the engine set (the engine registry's ready engines) and its held engines
        (`held`: paused, or behind on weights; they keep their pins but take no new pick).
        Kept URLs keep their client, health and model info; pins move with their engine,
        and pins to a removed engine are dropped, so those families re-pin on their next
        turn. A removed engine's client is not closed here: requests in flight on it hold
        it and finish."""
        new_urls = [u.rstrip("/") for u in urls]
        if len(set(new_urls)) != len(new_urls):
            raise ValueError(f"upstream URLs must be distinct: {new_urls}")
        if new_urls == self.urls:
            # Only the held set changed: the policy (its trees, its counts) stays.
            self._set_held(held)
            return
        old_index = {url: index for index, url in enumerate(self.urls)}
        clients: list[EngineClient] = []
        healthy: list[bool] = []
        last_error: list[str | None] = []
        model_info: list[dict[str, object] | None] = []
        breakers: list[CircuitBreaker] = []
        probes: list[HealthCounter] = []
        retries: list[int] = []
        for url in new_urls:
            index = old_index.get(url)
            if index is None:
                clients.append(EngineClient(url, timeout=self.timeout))
                healthy.append(True)
                last_error.append(None)
                model_info.append(None)
                breakers.append(new_breaker(self.reliability))
                probes.append(self._health_counter())
                retries.append(0)
            else:
                clients.append(self.clients[index])
                healthy.append(self.healthy[index])
                last_error.append(self.last_error[index])
                model_info.append(self._model_info[index])
                breakers.append(self.breakers[index])
                probes.append(self.probes[index])
                retries.append(self.retries[index])
        kept = set(new_urls)
        self._retired.extend(
            c for c, u in zip(self.clients, self.urls, strict=True) if u not in kept
        )
        new_index = {url: index for index, url in enumerate(new_urls)}
        pins: dict[str, int] = {}
        for root_id, index in self.pins.items():
            moved = new_index.get(self.urls[index])
            if moved is not None:
                pins[root_id] = moved
        self.urls, self.clients, self.healthy = new_urls, clients, healthy
        self.last_error, self._model_info, self.pins = last_error, model_info, pins
        self.breakers, self.probes, self.retries = breakers, probes, retries
        now = self.clock()
        self._open = {i for i, b in enumerate(breakers) if b.state(now) == OPEN}
        # The policy's state is by index: a new set gets a new policy (its prefix trees start
        # empty), told the availability the kept engines have.
        self.engine_policy = self._policy_for(self.urls)
        self.hold.set_held(held)
        for index in range(len(self.urls)):
            self.engine_policy.set_healthy(index, self._eligible(index, now))
        logger.warning("upstream set is now %s", ", ".join(new_urls) or "(empty)")

    def _set_held(self, held: Sequence[str]) -> None:
        self.hold.set_held(held)
        now = self.clock()
        for index in range(len(self.urls)):
            self.engine_policy.set_healthy(index, self._eligible(index, now))

    def _mark_client(self, client: EngineClient, error: str | None) -> None:
        index = self._index_of(client)
        if index is not None:
            self._mark(index, error)

    def _mark(self, index: int, error: str | None, *, from_probe: bool = False) -> None:
        """Record upstream `index` as up (`error` None) or down because of `error`."""
        up = error is None
        if up != self.healthy[index]:
            if up:
                logger.warning("upstream %s is up", self.urls[index])
            else:
                logger.warning("upstream %s is down: %s", self.urls[index], error)
        if not from_probe:
            # A real request decided: the probes' streak starts again from here.
            self.probes[index].reset()
        self.healthy[index] = up
        self.last_error[index] = error
        self.engine_policy.set_healthy(index, self._eligible(index, self.clock()))

    def _available(self, index: int, now: float) -> bool:
        """Healthy, and its circuit breaker not open: a candidate for requests."""
        return self.healthy[index] and self.breakers[index].allows(now)

    def _eligible(self, index: int, now: float) -> bool:
        """Available and not held: what the policy is told, so no new pick goes to a
        paused engine while another can take it."""
        return self._available(index, now) and not self.hold.is_held(self.urls[index])

    def _half_open_due(self) -> None:
        """Open breakers past their timeout let trial requests through again."""
        if not self._open:
            return
        now = self.clock()
        for index in [i for i in self._open if i < len(self.urls)]:
            if self.breakers[index].state(now) != OPEN:
                self._open.discard(index)
                logger.warning("upstream %s: circuit breaker half-open", self.urls[index])
                self.engine_policy.set_healthy(
                    index, self.healthy[index] and not self.hold.is_held(self.urls[index])
                )

    def _outcome(self, client: EngineClient, success: bool) -> None:
        """Count one attempt's outcome in its engine's breaker (a removed engine's: none)."""
        index = self._index_of(client)
        if index is None:
            return
        now = self.clock()
        breaker = self.breakers[index]
        before = breaker.state(now)
        after = breaker.record(success, now)
        if after == before:
            return
        if after == OPEN:
            self._open.add(index)
            logger.warning(
                "upstream %s: circuit breaker open for %gs",
                self.urls[index],
                breaker.timeout_secs,
            )
        else:
            logger.warning("upstream %s: circuit breaker closed", self.urls[index])
        self.engine_policy.set_healthy(index, self._eligible(index, now))

    def _answered(self, index: int, status: int) -> None:
        """A real request got a reply: the upstream is reachable again. A 5xx proves nothing
        either way (an engine may answer 503 while it loads), so it leaves the state alone."""
        if status < 500 and not self.healthy[index]:
            self._mark(index, None)

    @property
    def all_down(self) -> bool:
        return not any(self.healthy)

    def down_reason(self) -> str:
        """Why no upstream can take a turn, for `/health`."""
        if not self.urls:
            return NO_ENGINE
        # Each error names its URL already (probe and transport messages both do).
        errors = (
            error or f"{url} is down" for url, error in zip(self.urls, self.last_error, strict=True)
        )
        return "every upstream is down: " + "; ".join(errors)

    def _choose(self, root_id: str, avoid: int | None = None) -> int:
        order = rendezvous_order(root_id, self.urls)
        now = self.clock()
        # A held engine only when every available one is held (the request then waits).
        for index in order:
            if index != avoid and self._eligible(index, now):
                return index
        for index in order:
            if index != avoid and self._available(index, now):
                return index
        # Nothing known healthy: the first preference that is not the one that just failed.
        return next((i for i in order if i != avoid), order[0])

    def _place(
        self,
        root_id: str,
        headers: Sequence[tuple[str, str]],
        body: bytes,
        avoid: int | None = None,
    ) -> int:
        """Where a family goes now (its first call, or its engine is down): the policy's
        pick for this call, or its rendezvous choice (`RENDEZVOUS_PLACEMENT`)."""
        if not self.places_by_policy:
            return self._choose(root_id, avoid)
        # The policy picks among the healthy engines, so it avoids a down one by itself.
        index = self.engine_policy.pick(list(headers), body)
        if index == avoid or index >= len(self.urls):
            # Every engine is down (the policy then picks among all): any other than the
            # one that just failed, as the rendezvous placement does.
            return self._choose(root_id, avoid)
        return index

    def _peek(self, root_id: str | None) -> int:
        """The family's engine, or the one its rendezvous order prefers before it has one,
        without placing it (the policy must see the family's first real call)."""
        if root_id is not None:
            pinned = self.pins.get(root_id)
            if pinned is not None and self.healthy[pinned]:
                return pinned
        return self._choose(root_id or "")

    def index_for(
        self,
        root_id: str | None,
        headers: Sequence[tuple[str, str]] = (),
        body: bytes = b"",
    ) -> int:
        """The upstream of a session family (placed by its first call, then pinned); for
        stateless traffic, the engine routing policy's pick for a request with these headers
        and body."""
        if not self.urls:
            raise Unavailable(NO_ENGINE)
        self._half_open_due()
        if root_id is None:
            return self.engine_policy.pick(list(headers), body)
        pinned = self.pins.get(root_id)
        if pinned is not None and self._available(pinned, self.clock()):
            self.affinity_hits += 1
            # Not a pick, but the policy learns it (cache_aware: the turn's prompt, its work).
            self.engine_policy.record(pinned, list(headers), body)
            return pinned
        # Its engine is down: the policy's pick skips it, rendezvous's first healthy choice too.
        index = self._place(root_id, headers, body)
        if pinned is not None and pinned != index:
            self.repins += 1
        self.pins[root_id] = index
        return index

    def _transport_failed(self, client: EngineClient, exc: EngineTransportError) -> None:
        self._outcome(client, False)
        # A timed-out request says the engine is slow, not that it is gone; the probe (with
        # its own short timeout) decides whether it is answering at all.
        if not exc.timed_out:
            self._mark_client(client, str(exc))

    def _failed(
        self,
        root_id: str | None,
        index: int,
        headers: Sequence[tuple[str, str]] = (),
        body: bytes = b"",
    ) -> int | None:
        """Re-pin the family off `index` (already marked down); the upstream to retry on, if
        any. A stateless request retries on the next engine in the rendezvous order of the
        empty key (`retry_target`, the compiled front's choice too)."""
        if len(self.urls) <= 1 or index >= len(self.urls):
            return None
        if root_id is None:
            now = self.clock()
            available = [self._available(i, now) for i in range(len(self.urls))]
            return retry_target(rendezvous_order("", self.urls), index, available)
        retry = self._place(root_id, headers, body, avoid=index)
        if retry == index:
            return None
        self.pins[root_id] = retry
        self.repins += 1
        return retry

    def forget(self, root_id: str) -> None:
        self.pins.pop(root_id, None)

    def _sticky_key(self, headers: list[tuple[str, str]], body: bytes) -> str | None:
        """The request's sticky key, counted with it in flight; nothing is read (not even
        the headers converted) without --sticky-sessions."""
        if not self.engine_routing.sticks:
            return None
        return self.engine_policy.sticky_key(headers, body)

    async def _with_retries(
        self,
        root_id: str | None,
        headers: list[tuple[str, str]],
        body: bytes,
        send: Callable[[int], Awaitable[Sent]],
        discard: Callable[[Sent], Awaitable[None]],
    ) -> Sent:
        """`send` on the chosen upstream, again after a backoff while it could not connect
        or the reply is a 429 / 503, up to `--retry-max-retries` attempts in all; the last
        reply (or error) is the caller's."""
        attempts = self.reliability.attempts
        index = await self._route(root_id, headers, body)
        attempt = 0
        while True:
            last = attempt + 1 >= attempts
            client = self.clients[index]
            try:
                sent = await send(index)
            except EngineUnreachable:
                # `send` marked the upstream down.
                if last:
                    raise
                unreachable = True
            else:
                if last or sent.status not in RETRYABLE_STATUSES:
                    return sent
                await discard(sent)
                unreachable = False
            failed = self._index_of(client)
            if failed is not None:
                self.retries[failed] += 1
            await asyncio.sleep(self._backoff(attempt))
            attempt += 1
            # The set may have changed while waiting: find the engine again.
            failed = self._index_of(client)
            # After a connect failure, elsewhere when there is an elsewhere (a family re-pins
            # there); after a refusal, the family's engine again or the policy's pick.
            following = (
                self._failed(root_id, failed, headers, body)
                if unreachable and failed is not None
                else None
            )
            if following is not None and not self.hold.is_held(self.urls[following]):
                index = following
            else:
                index = await self._route(root_id, headers, body)

    async def _route(
        self, root_id: str | None, headers: Sequence[tuple[str, str]], body: bytes
    ) -> int:
        """`index_for`, waiting while its engine is held (engines/hold.py)."""
        return await self.hold.route(
            lambda: self.index_for(root_id, headers, body), lambda index: self.urls[index]
        )

    def _backoff(self, attempt: int) -> float:
        """Seconds to wait after failed attempt `attempt` (0-based), jitter drawn here."""
        c = self.reliability
        sample = random.uniform(-1.0, 1.0)
        delay = backoff_ms(
            attempt,
            c.retry_initial_backoff_ms,
            c.retry_max_backoff_ms,
            c.retry_backoff_multiplier,
            c.retry_jitter_factor,
            sample,
        )
        return delay / 1000.0

    async def post_json(
        self,
        root_id: str | None,
        path: str,
        body: bytes,
        headers: Iterable[tuple[str, str]] = (),
    ) -> EngineReply:
        header_list = list(headers)
        key = self._sticky_key(header_list, body)
        prompt = self.siblings.key("POST", path, body)

        async def send(index: int) -> EngineReply:
            policy = self.engine_policy  # of this moment (a new engine set builds a new one)
            policy.started(index, key)
            # The belief of the pick (no await since), held against the reply's cached_tokens.
            held = policy.held(index, header_list, body)
            url = self.urls[index]
            try:
                await self._enter_siblings(index, prompt, header_list)
                self.sent[url] += 1
                written = self.hold.sending(url)
                try:
                    reply = await self._post_json(index, path, body, header_list, written)
                finally:
                    written()
                if reply.status == 200:
                    if held is not None:
                        watch = CachedTokensWatch()
                        watch.feed(reply.body)
                        self._learn(policy, index, url, header_list, body, held, watch)
                    # Its prompt is in the engine's cache now (cache_aware learns it).
                    policy.prefilled(index, header_list, body)
                return reply
            finally:
                if prompt is not None:
                    self.siblings.leave(url, prompt)
                policy.finished(index, None, key)

        async def discard(reply: EngineReply) -> None:
            pass

        return await self._with_retries(root_id, header_list, body, send, discard)

    def _learn(
        self,
        policy: EnginePolicy | NoEngine,
        index: int,
        url: str,
        headers: list[tuple[str, str]],
        body: bytes,
        held: int,
        watch: CachedTokensWatch,
    ) -> None:
        """Tell the policy the reply's cached_tokens against `held`, its belief at the pick
        (docs/routing.md, "What a reply's cached_tokens teaches"); count what was lost."""
        cached = watch.finish()
        if cached is not None:
            self.lost[url] += policy.cached(index, headers, body, held, cached)

    async def _post_json(
        self,
        index: int,
        path: str,
        body: bytes,
        headers: list[tuple[str, str]],
        written: Callable[[], None] | None = None,
    ) -> EngineReply:
        """One attempt on upstream `index`, recording what it says about the upstream."""
        client = self.clients[index]
        try:
            reply = await client.post_json(path, body, headers, on_sent=written)
        except EngineTransportError as exc:
            self._transport_failed(client, exc)
            raise
        self._answered_by(client, reply.status)
        return reply

    async def _enter_siblings(
        self, index: int, prompt: Key | None, headers: Sequence[tuple[str, str]]
    ) -> None:
        """Wait while the request's prompt is being warmed up on engine `index` (engines/
        siblings.py); the warm-up carries the request's `authorization`, nothing else."""
        if prompt is None:
            return
        client = self.clients[index]
        auth = [(k, v) for k, v in headers if k.lower() == "authorization"]

        async def warm_up(body: bytes) -> bool:
            now = self._index_of(client)  # the engine set may have changed since
            if now is None:
                return False
            # Counted in the engine's breaker as the compiled front's pool counts it.
            reply = await self._post_json(now, GENERATE_PATH, body, auth)
            return reply.status == 200

        await self.siblings.enter(self.urls[index], prompt, warm_up)

    def _answered_by(self, client: EngineClient, status: int) -> None:
        # A 5xx counts against the engine's breaker, a 4xx is the client's doing.
        self._outcome(client, status < 500)
        index = self._index_of(client)
        if index is not None:
            self._answered(index, status)

    async def open_stream(
        self,
        root_id: str | None,
        method: str,
        path: str,
        *,
        query: str = "",
        headers: Iterable[tuple[str, str]] = (),
        body: bytes = b"",
    ) -> EngineStream:
        header_list = list(headers)
        key = self._sticky_key(header_list, body)
        prompt = self.siblings.key(method, path, body)

        async def attempt(index: int) -> EngineStream:
            client = self.clients[index]
            # In flight from the request until its stream is closed; on the policy of this
            # moment (a change of the engine set builds a new one).
            policy = self.engine_policy
            policy.started(index, key)
            # The belief of the pick (no await since), held against the reply's cached_tokens.
            held = policy.held(index, header_list, body)
            url = self.urls[index]
            written: Callable[[], None] | None = None
            try:
                await self._enter_siblings(index, prompt, header_list)
                self.sent[client.base_url] += 1
                written = self.hold.sending(client.base_url)
                stream = await client.open_stream(
                    method, path, query=query, headers=header_list, body=body, on_sent=written
                )
            except BaseException as exc:
                if written is not None:
                    written()
                if prompt is not None:
                    self.siblings.leave(url, prompt)
                policy.finished(index, None, key)
                if isinstance(exc, EngineTransportError):
                    self._transport_failed(client, exc)
                raise
            stream.exchange.callback(policy.finished, index, None, key)
            if stream.status == 200:
                # Told when the stream ends: its head can come before the prefill.
                stream.exchange.callback(policy.prefilled, index, header_list, body)
                if held is not None:
                    # Registered last, so it runs first: the loss is told before `prefilled`.
                    stream.watch = watch = CachedTokensWatch()
                    stream.exchange.callback(
                        self._learn, policy, index, url, header_list, body, held, watch
                    )
            if prompt is not None:
                stream.exchange.callback(self.siblings.leave, url, prompt)
            self._answered_by(client, stream.status)
            return stream

        async def discard(stream: EngineStream) -> None:
            # Only its head was read: nothing of it reached the client.
            await stream.aclose()

        return await self._with_retries(root_id, header_list, body, attempt, discard)

    async def model_info(self, root_id: str | None) -> dict[str, object] | None:
        """The `/model_info` of the upstream `root_id` is pinned to (SGLang: the engine's
        parsers and weight version), asked once per upstream; None when it has none. Asked
        before a family's first turn, so it does not place the family: an unplaced family
        asks its rendezvous choice (the engines of one pool serve one model)."""
        if not self.urls:
            raise Unavailable(NO_ENGINE)
        index = self._peek(root_id)
        known = self._model_info[index]
        if known is not None:
            return known or None
        client = self.clients[index]
        try:
            stream = await client.open_stream("GET", "/model_info")
        except EngineTransportError:
            return None  # the turn itself will meet (and report) the same failure
        try:
            body = await stream.read_all() if stream.status == 200 else b""
        finally:
            await stream.aclose()
        try:
            info = json.loads(body) if body else None
        except ValueError:
            info = None
        current = self._index_of(client)  # the set may have changed meanwhile
        if not isinstance(info, dict):
            if current is not None:
                self._model_info[current] = {}  # asked once: every turn would ask again
            return None
        if current is not None:
            self._model_info[current] = info
        return info

    def upstream_states(self) -> list[dict[str, object]]:
        """`[{"url", "healthy", "circuit_breaker", "retries", "last_error"?}]`: what `/health`
        shows of each upstream."""
        states: list[dict[str, object]] = []
        now = self.clock()
        for index, (url, healthy, error) in enumerate(
            zip(self.urls, self.healthy, self.last_error, strict=True)
        ):
            state: dict[str, object] = {
                "url": url,
                "healthy": healthy,
                "circuit_breaker": STATE_NAMES[self.breakers[index].state(now)],
                "retries": self.retries[index],
            }
            if error is not None:
                state["last_error"] = error
            states.append(state)
        return states

    def engine_counts(self) -> list[dict[str, object]]:
        """`[{"url", "in_flight", "sent", "lost"}]` per engine of the set: requests in flight
        as the engine policy counts them (from the pick until the reply is relayed),
        requests sent and prompt tokens learned lost, for /metrics' per-engine figures."""
        in_flight = self.engine_policy.in_flight
        return [
            {"url": url, "in_flight": int(n), "sent": self.sent[url], "lost": self.lost[url]}
            for url, n in zip(self.urls, in_flight, strict=True)
        ]

    def status(self) -> dict[str, object]:
        return {
            # "down" when no upstream is healthy: every turn of this core would fail.
            "upstream": "down" if self.all_down else "ok",
            "upstreams": self.upstream_states(),
            "affinity_hits": self.affinity_hits,
            "repins": self.repins,
            "pinned_trees": len(self.pins),  # families; the field keeps its earlier name
            "held": self.hold.status(),
            "siblings": self.siblings.stats(),
        }

    async def aclose(self) -> None:
        if self._load_poll is not None:
            await self._load_poll.aclose()
        for task in (self._prober, self._evictor):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for client in [*self.clients, *self._retired]:
            await client.aclose()

"""The engine set of one gateway: every engine it may send work to, static (`--backend`) or
registered at run time, with a stable id and a state.

States: `probing` (registered, not answered yet), `ready`, `unreachable: <why>`, `refused:
<why>` (its SGLang version renders prompts differently from the gateway's rules:
engines/engine_versions.py; a registration so refused is answered 409 and forgotten). An engine
is admitted to the set the session cores use the first time its probe passes (a static
engine is admitted at start, exactly as before registries existed); once admitted it stays
until removed, and the pools' own health checks steer traffic around it while it is down, so
a flapping engine does not re-pin families back and forth. An engine never admitted (a
wrong URL) is listed with why and never takes traffic.

The embedded mock engine (`serve` without `--backend`) is a placeholder: the first
registration removes it from the set, so it can never answer a request meant for a
registered engine.

Whenever the admitted set changes, `on_change` gets the new URL list (the in-process core's
pool, or the router's message to every worker); so it does when the **held** engines change
(`held()`: paused through the RL control plane or seen paused by their `/ready`, or behind
the newest weight version under `--newest-weights-only`), which every pool then stops
picking (engines/hold.py). Each engine's weight version is learned from its model info at
admission and after each weight update passed through the plane (rl/plane.py).

The registry's prober is the one prober of its process: each interval it probes every engine
once (`GET` of the health path; a registration's admission probe reads the model info too),
keeps its own state from the verdict and passes the verdict on to every pool of the process
that `feed` gave it (the compiled front's relay pool, the in-process core's `EnginePool`).
Those apply their `--health-*-threshold`s to it as to a probe of their own, and run none:
probing an engine once per pool only multiplied the requests an engine answers and let the
pools of one process disagree about it for an interval. So does its load poll
(`feed_loads`, engines/loads.py), when a policy of the process reads `GET /v1/loads`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from sessiongate.config.rl import split_label
from sessiongate.engines.engine_versions import AUTO, registration_refusal
from sessiongate.engines.loads import LoadFetcher, LoadPoll, LoadSink, fetch_loads
from sessiongate.engines.probe import (
    PROBE_TIMEOUT_S,
    ProbeResult,
    check,
    describe,
    probe,
    readiness,
)
from sessiongate.errors import Conflict

logger = logging.getLogger(__name__)

PROBING = "probing"
READY = "ready"

Prober = Callable[[str], Awaitable[ProbeResult]]
# (url, path, timeout) -> None when healthy, else why not.
Checker = Callable[[str, str, float], Awaitable[str | None]]
# A pool told each health verdict: (url, None when healthy, else why not).
HealthSink = Callable[[str, str | None], None]
OnChange = Callable[[list[str]], Awaitable[None]]
# (url, timeout) -> True when ready, False when paused, None when the engine does not say.
ReadyChecker = Callable[[str, float], Awaitable[bool | None]]
# `Engine.paused` of an engine whose `/ready` said it is paused.
OBSERVED = "observed"


class BadEngineUrl(ValueError):
    pass


def normalise_url(raw: str) -> str:
    """`scheme://host[:port][/prefix]` with scheme and host lowercased and no trailing "/";
    BadEngineUrl for anything else (a query, a fragment, credentials, no host)."""
    text = raw.strip()
    try:
        parts = urlsplit(text)
        port = parts.port  # ValueError on a port that is not a number in range
    except ValueError as exc:
        raise BadEngineUrl(f"{raw!r} is not a valid URL: {exc}") from exc
    if parts.scheme.lower() not in ("http", "https"):
        raise BadEngineUrl(f"{raw!r} must be an http:// or https:// URL")
    if not parts.hostname:
        raise BadEngineUrl(f"{raw!r} has no host")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise BadEngineUrl(f"{raw!r} must be a base URL (no query, fragment or credentials)")
    host = parts.hostname.lower()
    if ":" in host:
        host = f"[{host}]"  # IPv6
    netloc = host if port is None else f"{host}:{port}"
    return f"{parts.scheme.lower()}://{netloc}{parts.path.rstrip('/')}"


def same_engine(given: str, normalised: str) -> bool:
    """Whether the URL a pool was given names the engine the registry knows as `normalised`
    (a pool keeps its URLs as given: `--backend` as typed, minus a trailing "/")."""
    if given == normalised:
        return True
    try:
        return normalise_url(given) == normalised
    except BadEngineUrl:
        return False


def engine_id(url: str) -> str:
    """Stable across restarts and processes: the same URL always gets the same id, so a
    client that registers again (or asks after a gateway restart) finds it."""
    return "engine-" + hashlib.blake2b(url.encode(), digest_size=6).hexdigest()


@dataclass
class Engine:
    id: str
    url: str
    # True for `--backend` engines (given at start), False for registered ones.
    static: bool
    state: str = PROBING
    admitted: bool = False
    registered_at: float = field(default_factory=time.time)
    model_info: dict[str, object] | None = None
    server_info: dict[str, object] | None = None
    # Labels the RL control plane's selectors match (registration's "labels", --engine-label).
    labels: dict[str, str] = field(default_factory=dict)
    # The weight version the engine samples with, as last learned (its model info at
    # admission, a weight update passed through the control plane): docs/routing.md,
    # "Weight versions and pauses". None: not known (not an SGLang engine).
    weight_version: str | None = None
    # Why the engine takes no new request: the pause mode passed through the control plane
    # ("abort", "retract", "in_place"), or "observed" (its `/ready` answered 503); None when
    # it is not paused.
    paused: str | None = None
    # Control calls through the plane in progress on this engine, and a count of the pause
    # transitions they made: a readiness probe that overlaps either is not believed.
    control_calls: int = 0
    pause_epoch: int = 0

    @property
    def healthy(self) -> bool:
        return self.state == READY

    def describe(self) -> dict[str, object]:
        """One engine in the new dialect's listing (`GET /workers`), plus our fields."""
        document: dict[str, object] = {
            "id": self.id,
            "url": self.url,
            "worker_type": "regular",
            "is_healthy": self.healthy,
            "load": 0,
            "state": self.state,
            "static": self.static,
            "in_rotation": self.admitted,
            "weight_version": self.weight_version,
            "paused": self.paused is not None,
        }
        if self.paused is not None:
            document["pause_mode"] = self.paused
        if self.labels:
            document["labels"] = dict(self.labels)
        model = self.model_info.get("model_path") if self.model_info else None
        if isinstance(model, str):
            document["model_id"] = model
        return document


class EngineRegistry:
    def __init__(
        self,
        static_urls: Sequence[str],
        *,
        placeholder: bool = False,
        on_change: OnChange | None = None,
        prober: Prober = probe,
        interval: float = 5.0,
        health_path: str = "/health",
        health_timeout: float = PROBE_TIMEOUT_S,
        checker: Checker = check,
        sglang_version: str = AUTO,
        ready_checker: ReadyChecker = readiness,
        newest_weights_only: bool = False,
        labels: Sequence[str] = (),
        load_interval: float | None = None,
        load_fetcher: LoadFetcher = fetch_loads,
    ) -> None:
        """`static_urls`: the `--backend` engines (admitted from the start); `placeholder`:
        they are the embedded mock, replaced by the first registration. `prober` admits a
        registered engine; `checker` is the periodic health probe (`health_path`, within
        `health_timeout`: `--health-check-endpoint`, `--health-check-timeout-secs`).
        `sglang_version`: the SGLang version whose rules the session cores render by; a
        registered engine whose version renders differently is refused (`auto`: none is).
        `ready_checker`: the readiness probe that observes pauses; `newest_weights_only`:
        engines behind the newest weight version are held; `labels`: `[URL#]KEY=VALUE` of
        the static engines (`--engine-label`); `load_interval`: seconds between polls of
        the admitted engines' `GET /v1/loads` (`load_fetcher`), None when no policy of the
        process reads loads (`--load-monitor-interval`)."""
        self.engines: dict[str, Engine] = {}
        for raw in static_urls:
            url = normalise_url(raw)
            engine = Engine(engine_id(url), url, static=True, state=READY, admitted=True)
            self.engines[engine.id] = engine
        for text in labels:
            try:
                target, key, value = split_label(text)
                chosen = self.engines.values() if target is None else [self._static(target)]
            except ValueError as exc:
                raise SystemExit(str(exc)) from None
            for engine in list(chosen):
                engine.labels[key] = value
        self.placeholder = placeholder and bool(self.engines)
        self.on_change = on_change
        self.prober = prober
        self.interval = interval
        self.health_path = health_path
        self.health_timeout = health_timeout
        self.checker = checker
        self.sglang_version = sglang_version
        self.ready_checker = ready_checker
        self.newest_weights_only = newest_weights_only
        # The weight version most recently applied through the control plane (or the first
        # one learned): what `--newest-weights-only` routes to.
        self.newest_version: str | None = None
        self._held: list[str] = []
        self._sinks: list[HealthSink] = []
        self.load_poll = (
            LoadPoll(self.urls, load_interval, health_timeout, load_fetcher)
            if load_interval is not None
            else None
        )
        self._task: asyncio.Task[None] | None = None
        self._probes: dict[str, asyncio.Task[None]] = {}
        # Serialises `on_change` calls so the last set sent is the current one.
        self._change_lock = asyncio.Lock()
        # True once the set differs from the start-up one: the compiled front's engines
        # (fixed at start) are then stale.
        self.changed = False

    # -- queries ----------------------------------------------------------------------

    def urls(self) -> list[str]:
        """The admitted set, in registration order: what the session cores use."""
        return [e.url for e in self.engines.values() if e.admitted]

    def held(self) -> list[str]:
        """The admitted engines that take no new request: paused, or (under
        `--newest-weights-only`) at a known weight version other than the newest."""
        return [e.url for e in self.engines.values() if e.admitted and self._holds(e)]

    def _holds(self, engine: Engine) -> bool:
        if engine.paused is not None:
            return True
        return (
            self.newest_weights_only
            and self.newest_version is not None
            and engine.weight_version is not None
            and engine.weight_version != self.newest_version
        )

    def _static(self, raw_url: str) -> Engine:
        try:
            url = normalise_url(raw_url)
        except BadEngineUrl as exc:
            raise ValueError(f"--engine-label: {exc}") from None
        engine = self.engines.get(engine_id(url))
        if engine is None:
            raise ValueError(f"--engine-label: {raw_url} is not a --backend engine")
        return engine

    def find(self, key: str) -> Engine | None:
        """By id, or by URL (normalised; a `url@rank` suffix is not part of it)."""
        engine = self.engines.get(key)
        if engine is not None:
            return engine
        try:
            url = normalise_url(key)
        except BadEngineUrl:
            return None
        return self.engines.get(engine_id(url))

    def listing(self) -> list[Engine]:
        return list(self.engines.values())

    # -- changes ----------------------------------------------------------------------

    async def add(self, raw_url: str, labels: dict[str, str] | None = None) -> tuple[Engine, bool]:
        """Register `raw_url` (BadEngineUrl if it is not one) with `labels`;
        `(engine, created)`. Waits for the first probe, so the reply says whether the engine
        takes traffic already. Registering a known URL again is a no-op but for its labels,
        which are merged (the framework retries)."""
        url = normalise_url(raw_url)
        known = self.engines.get(engine_id(url))
        if known is not None and not (known.static and self.placeholder):
            known.labels.update(labels or {})
            return known, False
        placeholder, self.placeholder = self.placeholder, False
        stand_ins = [e for e in self.engines.values() if e.static] if placeholder else []
        if placeholder:
            # The first registration ends the mock's stand-in role, before the new engine
            # is even probed: no turn meant for it may reach the mock meanwhile.
            for engine in stand_ins:
                del self.engines[engine.id]
            logger.warning("the embedded mock engine leaves the engine set (an engine registered)")
        engine = Engine(engine_id(url), url, static=False, labels=dict(labels or {}))
        self.engines[engine.id] = engine
        if placeholder:
            await self._propagate()
        refusal = await self._probe(engine)
        if refusal is not None:
            await self._refuse(engine, stand_ins, refusal)
        return engine, True

    async def _refuse(self, engine: Engine, stand_ins: list[Engine], refusal: str) -> None:
        """Forget a registration the engine's SGLang version rules out (the mock it
        replaced, if any, stands in again) and answer 409 saying why."""
        self.engines.pop(engine.id, None)
        if stand_ins:
            for stand_in in stand_ins:
                self.engines[stand_in.id] = stand_in
            self.placeholder = True
            await self._propagate()
        logger.warning("engine %s refused: %s", engine.url, refusal)
        raise Conflict(f"engine {engine.url} refused: {refusal}")

    async def remove(self, key: str) -> Engine | None:
        """Remove an engine by id or URL; None if unknown. In-flight requests on it finish
        (the pools keep the client they hold); its families re-pin on their next turn."""
        engine = self.find(key)
        if engine is None:
            return None
        del self.engines[engine.id]
        task = self._probes.pop(engine.id, None)
        if task is not None:
            task.cancel()
        if engine.admitted:
            await self._propagate()
        return engine

    def feed(self, sink: HealthSink) -> None:
        """Pass every health verdict of this registry's prober to `sink` from now on (a pool
        that then probes nothing itself)."""
        self._sinks.append(sink)

    def feed_loads(self, sink: LoadSink) -> None:
        """Pass every `/v1/loads` poll outcome to `sink` from now on (nothing when no policy
        of the process reads loads: no poll runs)."""
        if self.load_poll is not None:
            self.load_poll.feed(sink)

    async def _probe(self, engine: Engine) -> str | None:
        """Probe `engine` for admission; why its SGLang version rules it out, if it does."""
        try:
            result = await self.prober(engine.url)
        except Exception as exc:  # a probe bug must not take the registry down
            result = ProbeResult(f"probe failed: {type(exc).__name__}: {exc}")
        if self.engines.get(engine.id) is not engine:
            return None  # removed while probing
        self._judged(engine, result.error)
        if result.error is None:
            engine.model_info = result.model_info
            engine.server_info = result.server_info
            self._learn_version(engine, result.model_info)
            version = (result.server_info or {}).get("version")
            refusal = registration_refusal(
                version if isinstance(version, str) else None, self.sglang_version
            )
            if refusal is not None:
                # Never admitted (a later probe of an engine that came up after its
                # registration lands here too: it stays listed, refused).
                engine.state = f"refused: {refusal}"
                return refusal
            if not engine.admitted:
                engine.admitted = True
                logger.warning("engine %s (%s) is ready", engine.id, engine.url)
                await self._propagate()
        return None

    def _judged(self, engine: Engine, error: str | None) -> None:
        """The engine's state after a probe said `error` (None: healthy)."""
        if error is None:
            engine.state = READY
            return
        if engine.state != f"unreachable: {error}":
            logger.warning("engine %s (%s) is unreachable: %s", engine.id, engine.url, error)
        engine.state = f"unreachable: {error}"

    async def _check(self, engine: Engine) -> None:
        """One periodic probe of an engine in the set: a health check, whose verdict the
        registry and every fed pool take (the embedded mock's: the pools only); an engine
        not known to be an SGLang one yet (a static engine) is then asked its model info."""
        try:
            error = await self.checker(engine.url, self.health_path, self.health_timeout)
        except Exception as exc:  # a probe bug must not take the registry down
            error = f"health probe failed: {type(exc).__name__}: {exc}"
        if self.engines.get(engine.id) is not engine:
            return  # removed while probing: no pool has it any more
        for sink in self._sinks:
            try:
                sink(engine.url, error)
            except Exception:  # one pool's bug must not keep the verdict from the others
                logger.exception("a pool did not take the health of %s", engine.url)
        if engine.static and self.placeholder:
            return
        self._judged(engine, error)
        if error is None and engine.model_info is None:
            result = await describe(engine.url)
            if result.error is None and self.engines.get(engine.id) is engine:
                engine.model_info = result.model_info
                engine.server_info = result.server_info
                self._learn_version(engine, result.model_info)
        if error is None:
            await self._observe_pause(engine)
        elif engine.paused is not None and not engine.control_calls:
            # A down engine is no longer paused for routing: the pools' health steers traffic
            # off it, and held requests must not wait for an engine that is gone (SGLang's
            # `/ready` is also 503 while it shuts down, which looks like a pause).
            logger.warning("engine %s (%s) is down: no longer held", engine.id, engine.url)
            engine.paused = None
            engine.pause_epoch += 1
            await self._hold_changed()

    # -- weight versions and pauses ----------------------------------------------------

    def _learn_version(self, engine: Engine, model_info: dict[str, object] | None) -> None:
        version = (model_info or {}).get("weight_version")
        if isinstance(version, str):
            engine.weight_version = version
            if self.newest_version is None:
                self.newest_version = version

    async def _observe_pause(self, engine: Engine) -> None:
        """Believe the engine's `/ready` (SGLang: 503 while paused) when no control call
        through the plane overlaps the probe: a pause or continue in progress is the
        plane's to record."""
        epoch = engine.pause_epoch
        if engine.control_calls:
            return
        try:
            ready = await self.ready_checker(engine.url, self.health_timeout)
        except Exception:  # a probe bug must not take the registry down
            logger.exception("readiness probe of %s failed", engine.url)
            return
        if ready is None or engine.control_calls or engine.pause_epoch != epoch:
            return
        if self.engines.get(engine.id) is not engine:
            return
        if not ready and engine.paused is None:
            logger.warning("engine %s (%s) is paused (its /ready says so)", engine.id, engine.url)
            engine.paused = OBSERVED
            await self._hold_changed()
        elif ready and engine.paused is not None:
            logger.warning("engine %s (%s) takes requests again", engine.id, engine.url)
            engine.paused = None
            # A pause is when weights change: one made behind the router's back is read
            # from the engine now (a new version is the newest: it came after the others).
            await self._reread_version(engine)
            await self._hold_changed()

    async def _reread_version(self, engine: Engine) -> None:
        result = await describe(engine.url)
        if result.error is not None or self.engines.get(engine.id) is not engine:
            return
        engine.model_info = result.model_info
        version = (result.model_info or {}).get("weight_version")
        if isinstance(version, str) and version != engine.weight_version:
            engine.weight_version = version
            self.newest_version = version

    def control_started(self, engine: Engine) -> None:
        """A control call through the plane begins on `engine` (readiness probes of it are
        not believed until it ends)."""
        engine.control_calls += 1

    def control_ended(self, engine: Engine) -> None:
        engine.control_calls = max(0, engine.control_calls - 1)

    async def pause(self, engine: Engine, mode: str) -> None:
        """Hold `engine` before its pause is sent: once this returns, every pool of the
        gateway has stopped picking it (the compiled front, the workers)."""
        engine.paused = mode
        engine.pause_epoch += 1
        await self._hold_changed()

    async def resume(self, engine: Engine) -> None:
        """Release `engine` (its continue succeeded, or its pause was refused)."""
        engine.paused = None
        engine.pause_epoch += 1
        await self._hold_changed()

    async def weights_updated(self, engine: Engine, version: str | None) -> None:
        """A weight update through the plane succeeded on `engine`: its version is read back
        from its model info (the engine's word), else taken from the call's body; it is the
        newest from now on."""
        result = await describe(engine.url)
        if result.error is None:
            engine.model_info = result.model_info
            found = (result.model_info or {}).get("weight_version")
            if isinstance(found, str):
                version = found
        if version is None:
            return
        engine.weight_version = version
        self.newest_version = version
        await self._hold_changed()

    async def _hold_changed(self) -> None:
        """Send the set again when the held engines changed."""
        held = self.held()
        if held != self._held:
            self._held = held
            await self._propagate()

    async def probe_once(self) -> None:
        """One probe of every engine: admitted ones are health-checked (`_check`), the
        others probed for admission."""
        engines = list(self.engines.values())
        await asyncio.gather(
            *(self._check(e) if e.admitted else self._probe(e) for e in engines),
            return_exceptions=True,
        )

    async def _propagate(self) -> None:
        self.changed = True
        self._held = self.held()
        if self.on_change is None:
            return
        async with self._change_lock:
            await self.on_change(self.urls())

    # -- lifetime ---------------------------------------------------------------------

    def start(self) -> None:
        """Probe every engine now and on the interval (needs a running loop; idempotent)."""
        if self._task is None:
            self._task = asyncio.create_task(self._probe_forever())
        if self.load_poll is not None:
            self.load_poll.start()

    async def _probe_forever(self) -> None:
        # From the start, not one interval in: `/health` must say an engine is down before
        # any traffic finds it so.
        while True:
            await self.probe_once()
            await asyncio.sleep(self.interval)

    async def aclose(self) -> None:
        if self.load_poll is not None:
            await self.load_poll.aclose()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

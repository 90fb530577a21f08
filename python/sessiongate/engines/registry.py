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
pool, or the router's message to every worker).

The registry's prober is the one prober of its process: each interval it probes every engine
once (`GET` of the health path; a registration's admission probe reads the model info too),
keeps its own state from the verdict and passes the verdict on to every pool of the process
that `feed` gave it (the compiled front's relay pool, the in-process core's `EnginePool`).
Those apply their `--health-*-threshold`s to it as to a probe of their own, and run none:
probing an engine once per pool only multiplied the requests an engine answers and let the
pools of one process disagree about it for an interval.
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

from sessiongate.engines.engine_versions import AUTO, registration_refusal
from sessiongate.engines.probe import PROBE_TIMEOUT_S, ProbeResult, check, describe, probe
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
        }
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
    ) -> None:
        """`static_urls`: the `--backend` engines (admitted from the start); `placeholder`:
        they are the embedded mock, replaced by the first registration. `prober` admits a
        registered engine; `checker` is the periodic health probe (`health_path`, within
        `health_timeout`: `--health-check-endpoint`, `--health-check-timeout-secs`).
        `sglang_version`: the SGLang version whose rules the session cores render by; a
        registered engine whose version renders differently is refused (`auto`: none is)."""
        self.engines: dict[str, Engine] = {}
        for raw in static_urls:
            url = normalise_url(raw)
            engine = Engine(engine_id(url), url, static=True, state=READY, admitted=True)
            self.engines[engine.id] = engine
        self.placeholder = placeholder and bool(self.engines)
        self.on_change = on_change
        self.prober = prober
        self.interval = interval
        self.health_path = health_path
        self.health_timeout = health_timeout
        self.checker = checker
        self.sglang_version = sglang_version
        self._sinks: list[HealthSink] = []
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

    async def add(self, raw_url: str) -> tuple[Engine, bool]:
        """Register `raw_url` (BadEngineUrl if it is not one); `(engine, created)`. Waits for
        the first probe, so the reply says whether the engine takes traffic already.
        Registering a known URL again is a no-op (the framework retries)."""
        url = normalise_url(raw_url)
        known = self.engines.get(engine_id(url))
        if known is not None and not (known.static and self.placeholder):
            return known, False
        placeholder, self.placeholder = self.placeholder, False
        stand_ins = [e for e in self.engines.values() if e.static] if placeholder else []
        if placeholder:
            # The first registration ends the mock's stand-in role, before the new engine
            # is even probed: no turn meant for it may reach the mock meanwhile.
            for engine in stand_ins:
                del self.engines[engine.id]
            logger.warning("the embedded mock engine leaves the engine set (an engine registered)")
        engine = Engine(engine_id(url), url, static=False)
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
        if self.on_change is None:
            return
        async with self._change_lock:
            await self.on_change(self.urls())

    # -- lifetime ---------------------------------------------------------------------

    def start(self) -> None:
        """Probe every engine now and on the interval (needs a running loop; idempotent)."""
        if self._task is None:
            self._task = asyncio.create_task(self._probe_forever())

    async def _probe_forever(self) -> None:
        # From the start, not one interval in: `/health` must say an engine is down before
        # any traffic finds it so.
        while True:
            await self.probe_once()
            await asyncio.sleep(self.interval)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

"""The engine set of one gateway: every engine it may send work to, static (`--backend`) or
registered at run time, with a stable id and a state.

States: `probing` (registered, not answered yet), `ready`, `unreachable: <why>`. An engine
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

from sessiongate.engines.probe import ProbeResult, probe

logger = logging.getLogger(__name__)

PROBING = "probing"
READY = "ready"

Prober = Callable[[str], Awaitable[ProbeResult]]
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
    ) -> None:
        """`static_urls`: the `--backend` engines (admitted from the start); `placeholder`:
        they are the embedded mock, replaced by the first registration."""
        self.engines: dict[str, Engine] = {}
        for raw in static_urls:
            url = normalise_url(raw)
            engine = Engine(engine_id(url), url, static=True, state=READY, admitted=True)
            self.engines[engine.id] = engine
        self.placeholder = placeholder and bool(self.engines)
        self.on_change = on_change
        self.prober = prober
        self.interval = interval
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
        if placeholder:
            # The first registration ends the mock's stand-in role, before the new engine
            # is even probed: no turn meant for it may reach the mock meanwhile.
            for engine in [e for e in self.engines.values() if e.static]:
                del self.engines[engine.id]
            logger.warning("the embedded mock engine leaves the engine set (an engine registered)")
        engine = Engine(engine_id(url), url, static=False)
        self.engines[engine.id] = engine
        if placeholder:
            await self._propagate()
        await self._probe(engine)
        return engine, True

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

    async def _probe(self, engine: Engine) -> None:
        try:
            result = await self.prober(engine.url)
        except Exception as exc:  # a probe bug must not take the registry down
            result = ProbeResult(f"probe failed: {type(exc).__name__}: {exc}")
        if self.engines.get(engine.id) is not engine:
            return  # removed while probing
        if result.error is None:
            engine.state = READY
            engine.model_info = result.model_info
            engine.server_info = result.server_info
            if not engine.admitted:
                engine.admitted = True
                logger.warning("engine %s (%s) is ready", engine.id, engine.url)
                await self._propagate()
        else:
            if engine.state != f"unreachable: {result.error}":
                logger.warning(
                    "engine %s (%s) is unreachable: %s", engine.id, engine.url, result.error
                )
            engine.state = f"unreachable: {result.error}"

    async def _propagate(self) -> None:
        self.changed = True
        if self.on_change is None:
            return
        async with self._change_lock:
            await self.on_change(self.urls())

    # -- lifetime ---------------------------------------------------------------------

    def start(self) -> None:
        """Re-probe every engine on the interval (needs a running loop; idempotent)."""
        if self._task is None:
            self._task = asyncio.create_task(self._probe_forever())

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            engines = [e for e in self.engines.values() if not (e.static and self.placeholder)]
            await asyncio.gather(*(self._probe(e) for e in engines), return_exceptions=True)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

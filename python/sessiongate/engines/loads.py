"""The load poll: `GET /v1/loads` of every engine every `--load-monitor-interval` seconds
(smg's default 10), for the policies that read loads (least_load, power_of_two:
`EngineRoutingConfig.reads_loads`), as smg 1.13's load monitor does.

SGLang's `/v1/loads` (entrypoints/v1_loads.py) answers `{"timestamp", "version",
"accelerator", "num_accelerators", "loads": [one LoadSnapshot.to_dict() per DP rank]}`; the
policies take one `LoadReport` per engine, summed over its ranks as smg does
(`WorkerLoadResponse`): `num_running_reqs`, `num_waiting_reqs`,
`num_waiting_uncached_tokens` and `gen_throughput` summed, `token_usage` averaged. A field
missing or of the wrong type in a rank counts as 0 (msgspec's omitted defaults).

An engine that does not answer within the poll's timeout (the interval, at most
`--health-check-timeout-secs`), answers an error status, or answers anything but that
document has **no** report from then on (`None` to the sinks): the policies score it on the
requests in flight through this process, until a poll succeeds again. Polls of one round run
concurrently, so one engine that never answers delays no other engine's report, and routing
never waits on a poll.

Where the engine registry lives (the in-process core, the router of the workers layout) its
poll feeds every policy of the process (`EngineRegistry.feed_loads`: the in-process core's
pool, the compiled front), as its prober feeds their health; a worker's pool polls for itself
(`EnginePool.start`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence

from sessiongate.engines.client import EngineClient, EngineTransportError
from sessiongate.engines.policy.base import LoadReport

logger = logging.getLogger(__name__)

LOADS_PATH = "/v1/loads"
# A sink told each poll's outcome: (url, the report, or None when there is none).
LoadSink = Callable[[str, LoadReport | None], None]
# (url, timeout) -> the engine's report, None when it gave none.
LoadFetcher = Callable[[str, float], Awaitable[LoadReport | None]]


def _count(rank: dict[str, object], name: str) -> int:
    value = rank.get(name)
    # bool is an int to Python but no count; a negative count is garbage.
    return value if type(value) is int and 0 <= value < 1 << 62 else 0


def _number(rank: dict[str, object], name: str) -> float:
    value = rank.get(name)
    if type(value) not in (int, float):
        return 0.0
    number = float(value)  # type: ignore[arg-type]
    return number if math.isfinite(number) and number >= 0 else 0.0


def parse_loads(body: bytes) -> LoadReport | None:
    """The report of a `/v1/loads` body, None when it is not SGLang's document (not JSON,
    no `loads` list of objects, or an empty one)."""
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(document, dict):
        return None
    ranks = document.get("loads")
    if not isinstance(ranks, list) or not ranks or not all(isinstance(r, dict) for r in ranks):
        return None
    usage = sum(_number(r, "token_usage") for r in ranks) / len(ranks)
    return LoadReport(
        running_reqs=sum(_count(r, "num_running_reqs") for r in ranks),
        waiting_reqs=sum(_count(r, "num_waiting_reqs") for r in ranks),
        waiting_tokens=sum(_count(r, "num_waiting_uncached_tokens") for r in ranks),
        token_usage=usage,
        throughput=sum(_number(r, "gen_throughput") for r in ranks),
    )


async def fetch_loads(url: str, timeout: float) -> LoadReport | None:
    """One `GET /v1/loads` of the engine at `url`: its report, None when it gave none in
    `timeout` seconds (no answer, an error status, a body that is not the document)."""
    client = EngineClient(url, timeout=timeout, connect_timeout=timeout)
    try:
        async with asyncio.timeout(timeout):
            stream = await client.open_stream("GET", LOADS_PATH)
            try:
                body = await stream.read_all()
            finally:
                await stream.aclose()
    except (EngineTransportError, TimeoutError, OSError):
        return None
    finally:
        await client.aclose()
    if not 200 <= stream.status < 300:
        return None
    return parse_loads(body)


class LoadPoll:
    """Polls `urls()` every `interval` seconds and tells each sink every outcome."""

    def __init__(
        self,
        urls: Callable[[], Sequence[str]],
        interval: float,
        timeout: float,
        fetch: LoadFetcher = fetch_loads,
    ) -> None:
        self.urls = urls
        self.interval = interval
        # A poll that outlived the interval would overlap the next round.
        self.timeout = min(timeout, interval)
        self.fetch = fetch
        self.sinks: list[LoadSink] = []
        self._task: asyncio.Task[None] | None = None
        # The engines that had a report at the last poll (to log a change once).
        self._reporting: dict[str, bool] = {}

    def feed(self, sink: LoadSink) -> None:
        self.sinks.append(sink)

    async def _one(self, url: str) -> None:
        try:
            report = await asyncio.wait_for(self.fetch(url, self.timeout), self.timeout)
        except Exception as exc:  # a poll bug (or a fetcher that overran) must not stop it
            logger.debug("GET %s%s failed: %r", url, LOADS_PATH, exc)
            report = None
        had = self._reporting.get(url)
        if had is not None and had != (report is not None):
            if report is None:
                logger.warning("engine %s gave no load report: scored on requests in flight", url)
            else:
                logger.warning("engine %s reports its load again", url)
        self._reporting[url] = report is not None
        for sink in self.sinks:
            try:
                sink(url, report)
            except Exception:  # one pool's bug must not keep the report from the others
                logger.exception("a pool did not take the load of %s", url)

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._one(url) for url in list(self.urls())))

    async def _forever(self) -> None:
        while True:
            began = time.monotonic()
            await self.poll_once()
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - began)))

    def start(self) -> None:
        """Poll now and every interval (needs a running loop; idempotent)."""
        if self._task is None:
            self._task = asyncio.create_task(self._forever())

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

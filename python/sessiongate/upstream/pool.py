"""Several upstreams with session-tree affinity.

Each session tree is pinned to one upstream, chosen by rendezvous (highest random weight)
hashing of its root id over the healthy upstreams, so a tree shares one replica and its
prefix cache, and removing an upstream moves only the trees that were on it. Upstreams are
probed periodically; a connection failure (nothing sent) marks the upstream down, re-pins
the tree to the next upstream in its rendezvous order and retries the request once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
from collections.abc import Iterable, Sequence

from sessiongate.upstream.client import (
    UpstreamClient,
    UpstreamReply,
    UpstreamStream,
    UpstreamUnreachable,
)

logger = logging.getLogger(__name__)


def rendezvous_order(key: str, urls: Sequence[str]) -> list[int]:
    """Indices of `urls` from most to least preferred for `key` (stable across processes)."""

    def weight(index: int) -> bytes:
        return hashlib.blake2b(f"{key}\x00{urls[index]}".encode(), digest_size=8).digest()

    return sorted(range(len(urls)), key=weight, reverse=True)


class UpstreamPool:
    def __init__(
        self,
        urls: Sequence[str],
        *,
        timeout: float = 600.0,
        health_interval: float = 5.0,
        health_path: str = "/health",
    ) -> None:
        if not urls:
            raise ValueError("at least one upstream URL is needed")
        self.urls = [u.rstrip("/") for u in urls]
        if len(set(self.urls)) != len(self.urls):
            raise ValueError(f"upstream URLs must be distinct: {self.urls}")
        self.clients = [UpstreamClient(u, timeout=timeout) for u in self.urls]
        self.healthy = [True] * len(self.urls)
        self.pins: dict[str, int] = {}
        self.affinity_hits = 0
        self.repins = 0
        self.health_interval = health_interval
        self.health_path = health_path
        self._round_robin = itertools.count()
        self._prober: asyncio.Task[None] | None = None

    @property
    def base_url(self) -> str:
        return ",".join(self.urls)

    def start(self) -> None:
        """Start periodic health checks (only useful with more than one upstream)."""
        if len(self.urls) > 1 and self._prober is None:
            self._prober = asyncio.create_task(self._probe_forever())

    async def _probe_forever(self) -> None:
        while True:
            results = await asyncio.gather(
                *(c.probe(self.health_path) for c in self.clients), return_exceptions=True
            )
            for index, ok in enumerate(results):
                up = ok is True
                if up != self.healthy[index]:
                    logger.warning("upstream %s is %s", self.urls[index], "up" if up else "down")
                self.healthy[index] = up
            await asyncio.sleep(self.health_interval)

    def _choose(self, root_id: str, avoid: int | None = None) -> int:
        order = rendezvous_order(root_id, self.urls)
        for index in order:
            if index != avoid and self.healthy[index]:
                return index
        # Nothing known healthy: the first preference that is not the one that just failed.
        return next((i for i in order if i != avoid), order[0])

    def index_for(self, root_id: str | None) -> int:
        """The upstream of a session tree (pinned on first use); any for stateless traffic."""
        if root_id is None:
            live = [i for i, ok in enumerate(self.healthy) if ok] or list(range(len(self.urls)))
            return live[next(self._round_robin) % len(live)]
        pinned = self.pins.get(root_id)
        if pinned is not None and self.healthy[pinned]:
            self.affinity_hits += 1
            return pinned
        index = self._choose(root_id)
        if pinned is not None and pinned != index:
            self.repins += 1
        self.pins[root_id] = index
        return index

    def _failed(self, root_id: str | None, index: int) -> int | None:
        """Mark `index` down and re-pin the tree; the upstream to retry on, if any."""
        self.healthy[index] = False
        if len(self.urls) == 1:
            return None
        retry = self._choose(root_id or "", avoid=index)
        if retry == index:
            return None
        if root_id is not None:
            self.pins[root_id] = retry
            self.repins += 1
        return retry

    def forget(self, root_id: str) -> None:
        self.pins.pop(root_id, None)

    async def post_json(
        self,
        root_id: str | None,
        path: str,
        body: bytes,
        headers: Iterable[tuple[str, str]] = (),
    ) -> UpstreamReply:
        index = self.index_for(root_id)
        header_list = list(headers)
        try:
            return await self.clients[index].post_json(path, body, header_list)
        except UpstreamUnreachable:
            retry = self._failed(root_id, index)
            if retry is None:
                raise
            return await self.clients[retry].post_json(path, body, header_list)

    async def open_stream(
        self,
        root_id: str | None,
        method: str,
        path: str,
        *,
        query: str = "",
        headers: Iterable[tuple[str, str]] = (),
        body: bytes = b"",
    ) -> UpstreamStream:
        index = self.index_for(root_id)
        header_list = list(headers)
        try:
            return await self.clients[index].open_stream(
                method, path, query=query, headers=header_list, body=body
            )
        except UpstreamUnreachable:
            retry = self._failed(root_id, index)
            if retry is None:
                raise
            return await self.clients[retry].open_stream(
                method, path, query=query, headers=header_list, body=body
            )

    def status(self) -> dict[str, object]:
        return {
            "upstreams": [
                {"url": u, "healthy": h} for u, h in zip(self.urls, self.healthy, strict=True)
            ],
            "affinity_hits": self.affinity_hits,
            "repins": self.repins,
            "pinned_trees": len(self.pins),
        }

    async def aclose(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prober
        for client in self.clients:
            await client.aclose()

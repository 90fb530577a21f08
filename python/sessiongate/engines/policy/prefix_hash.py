"""prefix_hash: the prompt's head hashed onto a consistent-hash ring of the engines, smg
1.13's rule (`model_gateway/src/policies/prefix_hash.rs`): requests sharing their first
`prefix_token_count` tokens go to one engine, and an engine coming or going moves only the
prefixes next to its own points.

The key is `X-SMG-Routing-Key` when the request has one, else the first
`prefix_token_count` token ids (as 32-bit little-endian units), else the first
4 x `prefix_token_count` characters of the text (UTF-8; lone surrogates encoded as code
points, as the compiled twin reads them). Without any, the candidate with the fewest
requests in flight (lowest index on a tie).

Each engine has `VNODES` points on the ring, blake2b-64 of `url#j`; the key's blake2b-64
finds the first point at or after it, and the walk goes on clockwise past engines that are
not candidates and past an **overloaded** one: more requests in flight than
max(load_factor x avg, avg + balance_abs_threshold), avg = (requests in flight over the
candidates + 1) / candidates (the +1 is the request being placed; nothing in flight: none
is overloaded). When every candidate is, the first one the walk met. (smg 1.9 went from an
overloaded target to the least loaded engine instead; 1.13's flag says it walks the ring.)
"""

from __future__ import annotations

import hashlib
import struct
from bisect import bisect_left

from sessiongate.config.engines import EngineRoutingConfig
from sessiongate.engines.policy.base import (
    ROUTING_KEY_HEADER,
    EngineStates,
    RoutingRequest,
    least,
)

# Points per engine: enough that 2-16 engines get shares within a few percent of even.
VNODES = 160
# Characters of text that stand for one token (smg's rule of thumb for English text).
CHARS_PER_TOKEN = 4


def hash64(data: bytes) -> int:
    """blake2b with an 8-byte digest, big-endian: the gateway's one hash (`hashing.py`)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class PrefixHash:
    name = "prefix_hash"

    def __init__(self, config: EngineRoutingConfig) -> None:
        self.count = config.prefix_token_count
        self.factor = float(config.prefix_hash_load_factor)
        self.abs_threshold = config.prefix_hash_balance_abs_threshold
        # Built on the first pick (the URLs are the engine states'), again if they change.
        self.ring_urls: list[str] = []
        self.points: list[int] = []
        self.owners: list[int] = []

    def _ring(self, urls: list[str]) -> None:
        if urls == self.ring_urls:
            return
        ring = sorted(
            (hash64(f"{url}#{j}".encode()), index)
            for index, url in enumerate(urls)
            for j in range(VNODES)
        )
        self.ring_urls = list(urls)
        self.points = [point for point, _ in ring]
        self.owners = [owner for _, owner in ring]

    def key(self, request: RoutingRequest) -> bytes | None:
        """The bytes hashed onto the ring, None when the request has nothing to hash."""
        header = request.header(ROUTING_KEY_HEADER)
        if header is not None:
            return header.encode("utf-8", "surrogateescape")
        material = request.material
        if material.ids:
            head = material.ids[: self.count]
            return struct.pack(f"<{len(head)}I", *head)
        if material.text:
            return material.text[: self.count * CHARS_PER_TOKEN].encode("utf-8", "surrogatepass")
        return None

    def pick(self, request: RoutingRequest, engines: EngineStates) -> int:
        candidates = engines.candidates()
        load = engines.in_flight
        key = self.key(request)
        if key is None:
            return least(candidates, load)[0]
        self._ring(engines.urls)
        total = sum(load[i] for i in candidates)
        avg = (total + 1) / len(candidates)
        limit = max(avg * self.factor, avg + self.abs_threshold)
        allowed = [False] * len(engines)
        for i in candidates:
            allowed[i] = True
        points, owners = self.points, self.owners
        start = bisect_left(points, hash64(key))
        seen = [False] * len(engines)
        met = 0
        first = -1
        for step in range(len(points)):
            owner = owners[(start + step) % len(points)]
            if not allowed[owner] or seen[owner]:
                continue
            if total == 0 or load[owner] <= limit:
                return owner
            if first < 0:
                first = owner
            seen[owner] = True
            met += 1
            if met == len(candidates):
                break
        return first

    def evict(self, now: float) -> None:
        pass

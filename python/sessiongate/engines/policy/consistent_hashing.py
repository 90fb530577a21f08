"""consistent_hashing: a key hashed over the engines, as the Gateway's.

`X-SMG-Target-Worker: N` sends the request to engine N when it exists and is healthy (else
the header is ignored). Otherwise the key is `X-SMG-Routing-Key`, else the first of
`Authorization`, `X-Forwarded-For`, `Cookie` present: the first candidate in the key's
rendezvous order over the engine URLs (blake2b, as the session pins of `engines/pool.py`),
so an engine going down moves only its own keys. Without any key, a random candidate.
"""

from __future__ import annotations

from sessiongate.engines.policy.base import (
    IMPLICIT_KEY_HEADERS,
    ROUTING_KEY_HEADER,
    TARGET_WORKER_HEADER,
    EngineStates,
    Rng,
    RoutingRequest,
)
from sessiongate.hashing import rendezvous_weight


class ConsistentHashing:
    name = "consistent_hashing"

    def __init__(self, seed: int) -> None:
        self.rng = Rng(seed)

    def pick(self, request: RoutingRequest, engines: EngineStates) -> int:
        target = request.header(TARGET_WORKER_HEADER)
        if target is not None and target.isascii() and target.isdigit() and len(target) < 19:
            index = int(target)
            if index < len(engines) and engines.healthy[index]:
                return index
        candidates = engines.candidates()
        key = request.header(ROUTING_KEY_HEADER)
        for name in IMPLICIT_KEY_HEADERS:
            if key is not None:
                break
            key = request.header(name)
        if key is None:
            return candidates[self.rng.below(len(candidates))]
        raw = key.encode("utf-8", "surrogateescape")
        # Highest weight first; the index breaks a (practically impossible) tie.
        return max(candidates, key=lambda i: (rendezvous_weight(raw, engines.urls[i]), -i))

    def evict(self, now: float) -> None:
        pass

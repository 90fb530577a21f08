"""The twin of `rust/hash.rs`: the rendezvous weight on the gateway's one hash (blake2b with
an 8-byte digest, read big-endian), which the engine pool's family placement and the engine
policy consistent_hashing both order engines by. Imports nothing, so option parsing that
reaches it does not load the compiled core."""

from __future__ import annotations

import hashlib


def rendezvous_weight(key: bytes, url: str) -> int:
    """blake2b-64 of `key \\0 url`: the highest weight wins (`rendezvous_weight` in Rust)."""
    digest = hashlib.blake2b(key + b"\x00" + url.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")

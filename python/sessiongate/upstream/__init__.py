"""HTTP clients for the inference engines (or external routers) behind sessiongate."""

from sessiongate.upstream.client import (
    UpstreamClient,
    UpstreamReply,
    UpstreamStream,
    UpstreamTransportError,
    UpstreamUnreachable,
)
from sessiongate.upstream.pool import UpstreamPool, rendezvous_order

__all__ = [
    "UpstreamClient",
    "UpstreamPool",
    "UpstreamReply",
    "UpstreamStream",
    "UpstreamTransportError",
    "UpstreamUnreachable",
    "rendezvous_order",
]

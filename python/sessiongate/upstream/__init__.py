"""HTTP client for the inference engines (or the external router) behind sessiongate."""

from sessiongate.upstream.client import UpstreamClient, UpstreamReply, UpstreamStream

__all__ = ["UpstreamClient", "UpstreamReply", "UpstreamStream"]

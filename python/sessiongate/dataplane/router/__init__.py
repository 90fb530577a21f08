"""The router: route by shard, the per-worker channels, /health and /metrics."""

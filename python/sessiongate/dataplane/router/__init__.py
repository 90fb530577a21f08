"""The router: dispatch by shard, the per-worker channels, /health and /metrics."""

"""`sessiongate demo`: mock engine + gateway + a short multi-turn agent workload."""

"""The engine routing policies, one module each, and the factory that builds one by name."""

from __future__ import annotations

import os

from sessiongate.config.engines import EngineRoutingConfig
from sessiongate.engines.policy.base import EngineStates, Policy, RoutingRequest
from sessiongate.engines.policy.cache_aware import CacheAware
from sessiongate.engines.policy.consistent_hashing import ConsistentHashing
from sessiongate.engines.policy.least_in_flight import LeastInFlight
from sessiongate.engines.policy.least_load import LeastLoad
from sessiongate.engines.policy.manual import Manual
from sessiongate.engines.policy.power_of_two import PowerOfTwo
from sessiongate.engines.policy.prefix_hash import PrefixHash
from sessiongate.engines.policy.random_pick import RandomPick
from sessiongate.engines.policy.round_robin import RoundRobin

__all__ = ["EngineStates", "Policy", "RoutingRequest", "make_policy"]


def make_policy(config: EngineRoutingConfig, engines: int) -> Policy:
    """The policy `config.policy` names, for `engines` engines."""
    seed = config.seed if config.seed is not None else int.from_bytes(os.urandom(8), "big")
    name = config.policy
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return RandomPick(seed)
    if name == "power_of_two":
        return PowerOfTwo(config, seed)
    if name == "least_in_flight":
        return LeastInFlight(config.tie_break)
    if name in ("cache_aware", "cache_aware_gateway"):
        return CacheAware(config, engines, gateway=name == "cache_aware_gateway")
    if name == "manual":
        return Manual(config, engines, seed)
    if name == "consistent_hashing":
        return ConsistentHashing(seed)
    if name == "least_load":
        return LeastLoad(config, seed)
    if name == "prefix_hash":
        return PrefixHash(config)
    raise ValueError(f"unknown policy {name!r}")  # the config validated it already

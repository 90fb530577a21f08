"""The engine routing policies, one module each, and the factory that builds one by name."""

from __future__ import annotations

import os

from sessiongate.engine_routing.config import EngineRoutingConfig
from sessiongate.engine_routing.policies.base import EngineStates, Policy, RoutingRequest
from sessiongate.engine_routing.policies.cache_aware import CacheAware
from sessiongate.engine_routing.policies.consistent_hashing import ConsistentHashing
from sessiongate.engine_routing.policies.least_in_flight import LeastInFlight
from sessiongate.engine_routing.policies.manual import Manual
from sessiongate.engine_routing.policies.power_of_two import PowerOfTwo
from sessiongate.engine_routing.policies.random_pick import RandomPick
from sessiongate.engine_routing.policies.round_robin import RoundRobin

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
        return PowerOfTwo(seed)
    if name == "least_in_flight":
        return LeastInFlight(config.tie_break)
    if name in ("cache_aware", "cache_aware_gateway"):
        return CacheAware(config, engines, gateway=name == "cache_aware_gateway")
    if name == "manual":
        return Manual(config, engines, seed)
    if name == "consistent_hashing":
        return ConsistentHashing(seed)
    raise ValueError(f"unknown policy {name!r}")  # the config validated it already

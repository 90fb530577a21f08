"""The one typed configuration of engine routing: the policy and its tunables.

Names and defaults follow the SGLang Model Gateway's command line (`--policy`,
`--cache-threshold`, ...), so a deployment can bring its router flags along; where the Gateway's
two launchers disagree (the Rust binary's `--eviction-interval 120` against the Python
launcher's `--eviction-interval-secs 60`), the Python launcher's value is the default.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

POLICIES = (
    "round_robin",
    "random",
    "power_of_two",
    "least_in_flight",
    "cache_aware",
    "cache_aware_gateway",
    "manual",
    "consistent_hashing",
)
DEFAULT_POLICY = "cache_aware"
ASSIGNMENT_MODES = ("random", "min_load", "min_group")
TIE_BREAKS = ("index", "round_robin")
# The policies that keep state a periodic `evict` trims.
EVICTING_POLICIES = frozenset({"cache_aware", "cache_aware_gateway", "manual"})


@dataclass(frozen=True)
class EngineRoutingConfig:
    """How stateless requests choose an engine (docs/routing.md, "Engine routing")."""

    policy: str = DEFAULT_POLICY
    # cache_aware: the prefix match ratio a request must exceed to follow its cache.
    cache_threshold: float = 0.3
    # cache_aware: the load spread above which the least loaded engine wins outright; both
    # must be exceeded (max - min > abs and max > rel * min).
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    # cache_aware and manual: seconds between trims of the trees / idle routing keys (0: never).
    eviction_interval_secs: int = 60
    # cache_aware: units (tokens or characters) each engine's tree keeps after a trim.
    max_tree_size: int = 1 << 26
    # manual: where a routing key seen for the first time goes.
    assignment_mode: str = "random"
    # manual: routing keys unused this long are forgotten at the next trim (0: never).
    max_idle_secs: int = 14_400
    # least_in_flight: among equally busy engines, the lowest index or the next in turn.
    tie_break: str = "index"
    # random, power_of_two, manual: the generator's seed (None: from the OS).
    seed: int | None = None

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem is not None:
            raise ValueError(problem)

    def problem(self) -> str | None:
        """What is wrong with these values, or None."""
        if self.policy not in POLICIES:
            return f"unknown policy {self.policy!r}; expected one of {', '.join(POLICIES)}"
        if not 0.0 <= self.cache_threshold <= 1.0:
            return f"cache_threshold must be in [0, 1], got {self.cache_threshold}"
        if self.balance_abs_threshold < 0:
            return f"balance_abs_threshold must be >= 0, got {self.balance_abs_threshold}"
        if not (math.isfinite(self.balance_rel_threshold) and self.balance_rel_threshold >= 0):
            return f"balance_rel_threshold must be a number >= 0, got {self.balance_rel_threshold}"
        if self.eviction_interval_secs < 0:
            return f"eviction_interval_secs must be >= 0, got {self.eviction_interval_secs}"
        if self.max_tree_size < 0:
            return f"max_tree_size must be >= 0, got {self.max_tree_size}"
        if self.assignment_mode not in ASSIGNMENT_MODES:
            return (
                f"unknown assignment_mode {self.assignment_mode!r}; expected one of "
                + ", ".join(ASSIGNMENT_MODES)
            )
        if self.max_idle_secs < 0:
            return f"max_idle_secs must be >= 0, got {self.max_idle_secs}"
        if self.tie_break not in TIE_BREAKS:
            return f"unknown tie_break {self.tie_break!r}; expected one of {', '.join(TIE_BREAKS)}"
        if self.seed is not None and not 0 <= self.seed < 1 << 64:
            return f"seed must be in [0, 2**64), got {self.seed}"
        return None

    def options(self) -> dict[str, object]:
        """The tunables as the policy classes take them (everything but the name)."""
        values = asdict(self)
        del values["policy"]
        return values

    @property
    def evicts(self) -> bool:
        """Whether a periodic `evict` has anything to do."""
        return self.policy in EVICTING_POLICIES and self.eviction_interval_secs > 0

"""The engines section: which engines, how they are reached and probed, how a stateless
request (and a session family's first call) chooses one, and what happens when one fails.

Names and defaults follow the SGLang Model Gateway's command line (`--policy`,
`--cache-threshold`, `--retry-*`, `--cb-*`, `--health-*`), so a deployment can bring its
router flags along; where the Gateway's two launchers disagree (the Rust binary's
`--eviction-interval 120` against the Python launcher's `--eviction-interval-secs 60`), the
Python launcher's value is the default. docs/routing.md, "Engine routing";
docs/reliability.md, "Engine-facing retries and the circuit breaker".
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

from sessiongate.config.fields import ONLY_SERVE, ONLY_WORKER, option, section

POLICIES = (
    "round_robin",
    "random",
    "power_of_two",
    "least_in_flight",
    "cache_aware",
    "cache_aware_gateway",
    "manual",
    "consistent_hashing",
    "least_load",
    "prefix_hash",
)
DEFAULT_POLICY = "cache_aware"
ASSIGNMENT_MODES = ("random", "min_load", "min_group")
TIE_BREAKS = ("index", "round_robin")
# What power_of_two compares between its two engines (smg 1.13's --power-of-two-load-metric).
LOAD_METRICS = ("expected_wait", "requests", "least_requests")
# The tunables each policy reads: its variant of the [engines.routing] table. A file that
# sets another policy's tunable is refused (config/cli.py); on the command line such flags
# are accepted and ignored, as the Gateway accepts them, so a command line can switch
# policies without dropping flags.
_CACHE_AWARE_TUNABLES = (
    "cache_threshold",
    "balance_abs_threshold",
    "balance_rel_threshold",
    "eviction_interval_secs",
    "max_tree_size",
)
# The expected-wait score's tunables (least_load's; power_of_two scores its pair with it).
_EXPECTED_WAIT_TUNABLES = (
    "least_load_kv_pressure_weight",
    "least_load_default_throughput",
    "least_load_mean_prefill_tokens",
    "load_monitor_interval",
)
_OWN_TUNABLES: dict[str, tuple[str, ...]] = {
    "round_robin": (),
    "random": ("seed",),
    "power_of_two": ("seed", "power_of_two_load_metric", *_EXPECTED_WAIT_TUNABLES),
    "least_in_flight": ("tie_break",),
    "cache_aware": _CACHE_AWARE_TUNABLES,
    "cache_aware_gateway": _CACHE_AWARE_TUNABLES,
    "manual": ("assignment_mode", "max_idle_secs", "eviction_interval_secs", "seed"),
    "consistent_hashing": ("seed",),
    "least_load": (*_EXPECTED_WAIT_TUNABLES, "least_load_max_waiting_requests", "seed"),
    "prefix_hash": (
        "prefix_token_count",
        "prefix_hash_load_factor",
        "prefix_hash_balance_abs_threshold",
    ),
}
# Read whatever the policy: overload protection narrows every policy's candidates.
_EVERY_POLICY_TUNABLES = (
    "hold_siblings",
    "worker_overload_protection",
    "worker_overload_waiting_requests",
    "worker_overload_token_usage",
    "load_monitor_interval",
)
# --sticky-sessions over every policy but the two that route on a key of their own.
_STICKY_TUNABLES = (
    "sticky_sessions",
    "routing_key_headers",
    "max_idle_secs",
    "eviction_interval_secs",
)
OWN_KEY_POLICIES = frozenset({"manual", "consistent_hashing"})
POLICY_TUNABLES: dict[str, tuple[str, ...]] = {
    name: tuple(
        dict.fromkeys(
            own + _EVERY_POLICY_TUNABLES + (() if name in OWN_KEY_POLICIES else _STICKY_TUNABLES)
        )
    )
    for name, own in _OWN_TUNABLES.items()
}
# The header smg's manual policy and sticky sessions read a routing key from.
ROUTING_KEY_HEADER = "x-smg-routing-key"
# What an HTTP header name is made of (RFC 9110's token).
_TOKEN_CHARS = frozenset(
    "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
)
# The policies that keep state a periodic `evict` trims (and any with --sticky-sessions).
EVICTING_POLICIES = frozenset({"cache_aware", "cache_aware_gateway", "manual"})
# The policies that read the engines' `GET /v1/loads` (polled every load_monitor_interval).
LOAD_READING_POLICIES = frozenset({"least_load", "power_of_two"})

# `serve --backend mock` (its default): the embedded mock engine, started by serve itself.
MOCK_BACKEND = "mock"
# `--backend none`: no engine at start; engines register at run time (docs/api.md, "Engine
# management"), turns answer 503 until one is ready.
NO_BACKEND = "none"
ADMIN_KEY_ENV = "SESSIONGATE_ADMIN_KEY"


@section(
    title="engine routing (which engine a stateless request goes to; docs/routing.md)",
    key="routing",
)
@dataclass(frozen=True)
class EngineRoutingConfig:
    """How stateless requests choose an engine (docs/routing.md, "Engine routing"): the
    policy and its variant's tunables (POLICY_TUNABLES). Every tunable is a field, so the
    command line keeps the Gateway's flat flags; the policy reads only its own."""

    policy: str = option(
        "--policy",
        default=DEFAULT_POLICY,
        choices=POLICIES,
        help=f"how stateless requests, and each session family's first call, choose an "
        f"engine ({DEFAULT_POLICY}); a family then stays on its engine (under round_robin "
        "families are placed by rendezvous hashing of the root id)",
    )
    cache_threshold: float = option(
        "--cache-threshold",
        "--cache-match-threshold",
        default=0.3,
        parse=float,
        metavar="RATIO",
        help="cache_aware: follow the engine holding the prompt's longest prefix when more "
        "than this share of the prompt matches (0.3)",
    )
    # Both must be exceeded (max - min > abs and max > rel * min).
    balance_abs_threshold: int = option(
        "--balance-abs-threshold",
        "--spill-abs-threshold",
        default=64,
        parse=int,
        metavar="N",
        help="cache_aware: requests in flight max - min above which (with the relative "
        "threshold) the least loaded engine wins (64)",
    )
    balance_rel_threshold: float = option(
        "--balance-rel-threshold",
        "--spill-rel-threshold",
        default=1.5,
        parse=float,
        metavar="RATIO",
        help="cache_aware: max > RATIO * min as well makes the engines imbalanced (1.5)",
    )
    eviction_interval_secs: int = option(
        "--eviction-interval-secs",
        "--eviction-interval",
        default=60,
        parse=int,
        metavar="SECONDS",
        help="cache_aware, manual: seconds between trims of the prefix trees and idle routing "
        "keys (60; 0 = never)",
    )
    max_tree_size: int = option(
        "--max-tree-size",
        default=1 << 26,
        parse=int,
        metavar="UNITS",
        help="cache_aware: tokens (or characters) each engine's prefix tree keeps after a "
        f"trim ({1 << 26})",
    )
    assignment_mode: str = option(
        "--assignment-mode",
        default="random",
        choices=ASSIGNMENT_MODES,
        help="manual: where a routing key seen for the first time goes (random)",
    )
    max_idle_secs: int = option(
        "--max-idle-secs",
        "--sticky-key-idle-secs",
        default=14_400,
        parse=int,
        metavar="SECONDS",
        help="manual, --sticky-sessions: forget routing keys unused this long (14400; 0 = never)",
    )
    # smg 1.13's routing-key override, with its names (router_args.py); sticky.py.
    sticky_sessions: bool = option(
        "--sticky-sessions",
        "--routing-key-override",
        default=False,
        kind="switch",
        help="every policy but manual and consistent_hashing: pin each routing key (the "
        "body's rid without its _r<n> and _t<n> suffixes, else --routing-key-headers) to "
        "the engine its first request went to; a key with 2 requests in flight there "
        "spills to the policy's pick",
    )
    routing_key_headers: tuple[str, ...] = option(
        "--routing-key-headers",
        default=(ROUTING_KEY_HEADER,),
        kind="list",
        metavar="NAME",
        help="--sticky-sessions: headers read, in order, for a request without a rid; the "
        f"first holding 1 to 128 bytes of UTF-8 wins ({ROUTING_KEY_HEADER})",
    )
    tie_break: str = option(
        "--tie-break",
        default="index",
        choices=TIE_BREAKS,
        help="least_in_flight: among equally busy engines the lowest index (the rollout "
        "router's rule) or each in turn (index)",
    )
    seed: int | None = option(
        "--policy-seed",
        default=None,
        parse=int,
        metavar="N",
        help="random, power_of_two, manual, consistent_hashing, least_load: seed of the random "
        "choices (default: from the OS)",
    )
    # smg 1.13's load-aware tunables, with its names and defaults (router_args.py).
    least_load_kv_pressure_weight: float = option(
        "--least-load-kv-pressure-weight",
        default=0.15,
        parse=float,
        metavar="SECONDS",
        help="least_load, power_of_two: weight of the KV-pressure term k/(1-k) of the expected "
        "wait, k the engine's KV token usage (0.15)",
    )
    least_load_default_throughput: float = option(
        "--least-load-default-throughput",
        default=2000.0,
        parse=float,
        metavar="TOKENS_PER_SEC",
        help="least_load, power_of_two: generation throughput assumed for an engine whose "
        "/v1/loads reports none (2000)",
    )
    least_load_mean_prefill_tokens: int = option(
        "--least-load-mean-prefill-tokens",
        default=1024,
        parse=int,
        metavar="TOKENS",
        help="least_load, power_of_two: tokens assumed for a request without token ids, and "
        "per queued request when an engine reports no queued tokens (1024)",
    )
    least_load_max_waiting_requests: int = option(
        "--least-load-max-waiting-requests",
        default=0,
        parse=int,
        metavar="N",
        help="least_load: skip engines whose reported waiting requests plus requests sent "
        "since their report reach N, while another is under it (0 = off)",
    )
    power_of_two_load_metric: str = option(
        "--power-of-two-load-metric",
        default="expected_wait",
        choices=LOAD_METRICS,
        help="power_of_two: what it compares between its two engines: the expected wait "
        "(least_load's score, once /v1/loads answered), the reported requests, or the "
        "requests in flight through this process (expected_wait)",
    )
    load_monitor_interval: int = option(
        "--load-monitor-interval",
        default=10,
        parse=int,
        metavar="SECONDS",
        help="least_load, power_of_two, --worker-overload-protection: seconds between polls of "
        "every engine's GET /v1/loads (10)",
    )
    hold_siblings: bool = option(
        "--hold-siblings",
        off_flags=("--no-hold-siblings",),
        default=True,
        kind="switch",
        help="every policy: a POST /generate whose prompt (64 or more token ids or characters) "
        "is already in flight on its engine waits for one prefill-only warm-up of that prompt "
        "there, so a GRPO group's samples prefill it once; while prompts come in groups, a "
        "new prompt's first request on a busy engine waits for its own warm-up too (on)",
    )
    # smg 1.13's overload protection, its flags and thresholds; off by default here
    # (docs/routing.md, "Overload protection").
    worker_overload_protection: bool = option(
        "--worker-overload-protection",
        off_flags=("--disable-worker-overload-protection",),
        default=False,
        kind="switch",
        help="every policy: leave out of routing an engine whose GET /v1/loads reports "
        "--worker-overload-waiting-requests queued requests or --worker-overload-token-usage "
        "of its KV cache, while another is under both (off: smg has it on)",
    )
    worker_overload_waiting_requests: int = option(
        "--worker-overload-waiting-requests",
        default=8,
        parse=int,
        metavar="N",
        help="--worker-overload-protection: queued requests (summed over DP ranks) at or above "
        "which an engine is overloaded (8)",
    )
    worker_overload_token_usage: float = option(
        "--worker-overload-token-usage",
        default=0.8,
        parse=float,
        metavar="RATIO",
        help="--worker-overload-protection: KV token usage (mean over DP ranks) at or above "
        "which an engine is overloaded (0.8)",
    )
    prefix_token_count: int = option(
        "--prefix-token-count",
        default=256,
        parse=int,
        metavar="TOKENS",
        help="prefix_hash: leading token ids hashed (four times as many characters of a "
        "prompt without ids) (256)",
    )
    prefix_hash_load_factor: float = option(
        "--prefix-hash-load-factor",
        default=1.25,
        parse=float,
        metavar="X",
        help="prefix_hash: an engine with more requests in flight than X times the average "
        "(and the absolute threshold) is passed over for the next on the ring (1.25)",
    )
    prefix_hash_balance_abs_threshold: int = option(
        "--prefix-hash-balance-abs-threshold",
        default=10,
        parse=int,
        metavar="N",
        help="prefix_hash: requests over the average an engine must also exceed to be "
        "passed over (10)",
    )

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
        if not self.routing_key_headers:
            return "routing_key_headers needs at least one header name"
        for name in self.routing_key_headers:
            if not (name and name.isascii() and all(c in _TOKEN_CHARS for c in name)):
                quoted = json.dumps(name, ensure_ascii=False)
                return f"routing_key_headers: {quoted} is not an HTTP header name"
        if self.tie_break not in TIE_BREAKS:
            return f"unknown tie_break {self.tie_break!r}; expected one of {', '.join(TIE_BREAKS)}"
        if not (
            math.isfinite(self.least_load_kv_pressure_weight)
            and self.least_load_kv_pressure_weight >= 0
        ):
            return (
                "least_load_kv_pressure_weight must be a number >= 0, got "
                f"{self.least_load_kv_pressure_weight}"
            )
        if not (
            math.isfinite(self.least_load_default_throughput)
            and self.least_load_default_throughput > 0
        ):
            return (
                "least_load_default_throughput must be a number > 0, got "
                f"{self.least_load_default_throughput}"
            )
        for name in ("least_load_mean_prefill_tokens", "load_monitor_interval"):
            if getattr(self, name) < 1:
                return f"{name} must be >= 1, got {getattr(self, name)}"
        for name in ("least_load_max_waiting_requests", "prefix_hash_balance_abs_threshold"):
            if getattr(self, name) < 0:
                return f"{name} must be >= 0, got {getattr(self, name)}"
        if self.power_of_two_load_metric not in LOAD_METRICS:
            return (
                f"unknown power_of_two_load_metric {self.power_of_two_load_metric!r}; expected "
                f"one of {', '.join(LOAD_METRICS)}"
            )
        if self.worker_overload_waiting_requests < 1:
            return (
                "worker_overload_waiting_requests must be >= 1, got "
                f"{self.worker_overload_waiting_requests}"
            )
        usage = self.worker_overload_token_usage
        if not (math.isfinite(usage) and 0 < usage <= 1):
            return f"worker_overload_token_usage must be in (0, 1], got {usage}"
        if self.prefix_token_count < 1:
            return f"prefix_token_count must be >= 1, got {self.prefix_token_count}"
        if not (math.isfinite(self.prefix_hash_load_factor) and self.prefix_hash_load_factor >= 1):
            return (
                f"prefix_hash_load_factor must be a number >= 1, got {self.prefix_hash_load_factor}"
            )
        if self.seed is not None and not 0 <= self.seed < 1 << 64:
            return f"seed must be in [0, 2**64), got {self.seed}"
        return None

    def options(self) -> dict[str, object]:
        """The tunables as the policy classes take them (everything but the name)."""
        values = asdict(self)
        del values["policy"]
        return values

    @property
    def reads_loads(self) -> bool:
        """Whether the policy reads the engines' `GET /v1/loads` (a poll has a reader)."""
        if self.worker_overload_protection:
            return True
        if self.policy == "power_of_two":
            return self.power_of_two_load_metric != "least_requests"
        return self.policy in LOAD_READING_POLICIES

    @property
    def sticks(self) -> bool:
        """Whether sticky keys apply: --sticky-sessions over a policy without its own key."""
        return self.sticky_sessions and self.policy not in OWN_KEY_POLICIES

    @property
    def evicts(self) -> bool:
        """Whether a periodic `evict` has anything to do."""
        keeps = self.policy in EVICTING_POLICIES or self.sticks
        return keeps and self.eviction_interval_secs > 0


@section(
    title="engine reliability (health thresholds, retries, circuit breaker; docs/reliability.md)",
    key="reliability",
)
@dataclass(frozen=True)
class ReliabilityConfig:
    """Health thresholds, retries and the circuit breaker (docs/reliability.md)."""

    health_failure_threshold: int = option(
        "--health-failure-threshold",
        default=3,
        parse=int,
        metavar="N",
        help="failed health probes in a row before an engine is marked down (3; a request "
        "that cannot connect marks it down at once)",
    )
    health_success_threshold: int = option(
        "--health-success-threshold",
        default=2,
        parse=int,
        metavar="N",
        help="passed health probes in a row before a down engine is up again (2)",
    )
    health_check_timeout_secs: float = option(
        "--health-check-timeout-secs",
        default=5.0,
        parse=float,
        metavar="SECONDS",
        help="each health probe's timeout (5)",
    )
    health_check_endpoint: str = option(
        "--health-check-endpoint",
        default="/health",
        metavar="PATH",
        help="the engines' health path (/health)",
    )
    # Attempts in all (the Gateway's meaning of its "max retries"): 5 = 1 try + 4 retries.
    retry_max_retries: int = option(
        "--retry-max-retries",
        default=5,
        parse=int,
        metavar="N",
        help="attempts per request in all, the first included, when an engine could not be "
        "connected to or answered 429 / 503 (5)",
    )
    retry_initial_backoff_ms: int = option(
        "--retry-initial-backoff-ms",
        default=50,
        parse=int,
        metavar="MS",
        help="wait before the first retry (50)",
    )
    retry_max_backoff_ms: int = option(
        "--retry-max-backoff-ms",
        default=30_000,
        parse=int,
        metavar="MS",
        help="the longest wait between attempts (30000)",
    )
    retry_backoff_multiplier: float = option(
        "--retry-backoff-multiplier",
        default=1.5,
        parse=float,
        metavar="X",
        help="each wait is the previous one times this (1.5)",
    )
    retry_jitter_factor: float = option(
        "--retry-jitter-factor",
        default=0.2,
        parse=float,
        metavar="RATIO",
        help="each wait moves randomly by up to this share of itself (0.2)",
    )
    disable_retries: bool = option(
        "--disable-retries",
        default=False,
        kind="switch",
        help="send every request once: no retry after a connect error, 429 or 503",
    )
    # Failures in a row, within the window, that open the breaker; trial successes that
    # close it again; seconds it stays open.
    cb_failure_threshold: int = option(
        "--cb-failure-threshold",
        default=10,
        parse=int,
        metavar="N",
        help="failures in a row (transport errors, 5xx replies) that open an engine's circuit "
        "breaker, taking it out of rotation (10)",
    )
    cb_success_threshold: int = option(
        "--cb-success-threshold",
        default=3,
        parse=int,
        metavar="N",
        help="trial successes in a row that close a half-open breaker (3)",
    )
    cb_timeout_duration_secs: float = option(
        "--cb-timeout-duration-secs",
        default=60.0,
        parse=float,
        metavar="SECONDS",
        help="how long an open breaker keeps its engine out before trial requests (60)",
    )
    cb_window_duration_secs: float = option(
        "--cb-window-duration-secs",
        default=120.0,
        parse=float,
        metavar="SECONDS",
        help="a failure streak older than this starts over (120)",
    )
    disable_circuit_breaker: bool = option(
        "--disable-circuit-breaker",
        default=False,
        kind="switch",
        help="never take an engine out of rotation for its failures (health probes still do)",
    )

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem is not None:
            raise ValueError(problem)

    def problem(self) -> str | None:
        """What is wrong with these values, or None."""
        for name in (
            "health_failure_threshold",
            "health_success_threshold",
            "retry_max_retries",
            "cb_failure_threshold",
            "cb_success_threshold",
        ):
            if getattr(self, name) < 1:
                return f"{name} must be >= 1, got {getattr(self, name)}"
        for name in ("retry_initial_backoff_ms", "retry_max_backoff_ms"):
            if getattr(self, name) < 0:
                return f"{name} must be >= 0, got {getattr(self, name)}"
        for name in (
            "health_check_timeout_secs",
            "cb_timeout_duration_secs",
            "cb_window_duration_secs",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                return f"{name} must be a number > 0, got {value}"
        multiplier = self.retry_backoff_multiplier
        if not (math.isfinite(multiplier) and multiplier >= 1.0):
            return f"retry_backoff_multiplier must be a number >= 1, got {multiplier}"
        if not 0.0 <= self.retry_jitter_factor <= 1.0:
            return f"retry_jitter_factor must be in [0, 1], got {self.retry_jitter_factor}"
        if not self.health_check_endpoint.startswith("/"):
            return f"health_check_endpoint must start with '/', got {self.health_check_endpoint!r}"
        return None

    @property
    def attempts(self) -> int:
        """How many times one request may be sent (1 with retries off)."""
        return 1 if self.disable_retries else self.retry_max_retries


@section(title="engines (the inference servers behind the gateway)", key="engines")
@dataclass(frozen=True)
class EnginesConfig:
    """The engines and how they are reached."""

    urls: tuple[str, ...] | None = option(
        "--backend",
        kind="append",
        required_in=ONLY_WORKER,
        help="engine base URL (an SGLang-style engine or router); repeat for several engines "
        "(each session family is pinned to one, placed by --policy). serve: 'mock' (the "
        "default) starts the built-in mock engine; 'none' starts with no engine and waits "
        "for engines to register (POST /workers or /add_worker)",
    )
    health_interval: float = option(
        "--health-interval",
        default=5.0,
        parse=float,
        help="seconds between engine health checks (GET /health; 5)",
    )
    timeout: float = option(
        "--timeout", default=600.0, parse=float, help="engine request timeout in seconds (600)"
    )
    admin_key: str | None = option(
        "--admin-key",
        commands=ONLY_SERVE,
        env=ADMIN_KEY_ENV,
        secret=True,
        help="require 'Authorization: Bearer KEY' on the engine management routes "
        "(/workers, /add_worker, ...) instead of --api-key (default: $SESSIONGATE_ADMIN_KEY; "
        "without either, they are open like the rest of the gateway)",
    )
    mock_args: str = option(
        "--mock-args",
        default="",
        commands=ONLY_SERVE,
        help='extra arguments for the embedded mock engine, e.g. "--r3-layers 48 --r3-topk 8"',
    )
    routing: EngineRoutingConfig = field(default_factory=EngineRoutingConfig)
    reliability: ReliabilityConfig = field(default_factory=ReliabilityConfig)

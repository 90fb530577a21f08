"""Command-line options of engine routing (`--policy` and its tunables), shared by `serve`,
the router process (the compiled front) and the worker processes (the Python proxy path):
declared once, validated once, forwarded as argv. The flag names are the SGLang Model
Gateway's, so its users can bring their command line (docs/routing.md, "Engine routing").
"""

from __future__ import annotations

import argparse

from sessiongate.engines.policy.config import (
    ASSIGNMENT_MODES,
    DEFAULT_POLICY,
    POLICIES,
    TIE_BREAKS,
    EngineRoutingConfig,
)
from sessiongate.engines.reliability import ReliabilityConfig

_DEFAULTS = EngineRoutingConfig()


def add_engine_routing_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "engine routing (which engine a stateless request goes to; docs/routing.md)"
    )
    group.add_argument(
        "--policy",
        choices=POLICIES,
        default=DEFAULT_POLICY,
        help=f"how stateless requests, and each session family's first call, choose an "
        f"engine ({DEFAULT_POLICY}); a family then stays on its engine (under round_robin "
        "families are placed by rendezvous hashing of the root id)",
    )
    group.add_argument(
        "--cache-threshold",
        type=float,
        default=_DEFAULTS.cache_threshold,
        metavar="RATIO",
        help="cache_aware: follow the engine holding the prompt's longest prefix when more "
        f"than this share of the prompt matches ({_DEFAULTS.cache_threshold})",
    )
    group.add_argument(
        "--balance-abs-threshold",
        type=int,
        default=_DEFAULTS.balance_abs_threshold,
        metavar="N",
        help="cache_aware: requests in flight max - min above which (with the relative "
        f"threshold) the least loaded engine wins ({_DEFAULTS.balance_abs_threshold})",
    )
    group.add_argument(
        "--balance-rel-threshold",
        type=float,
        default=_DEFAULTS.balance_rel_threshold,
        metavar="RATIO",
        help="cache_aware: max > RATIO * min as well makes the engines imbalanced "
        f"({_DEFAULTS.balance_rel_threshold})",
    )
    group.add_argument(
        "--eviction-interval-secs",
        "--eviction-interval",
        dest="eviction_interval_secs",
        type=int,
        default=_DEFAULTS.eviction_interval_secs,
        metavar="SECONDS",
        help="cache_aware, manual: seconds between trims of the prefix trees and idle routing "
        f"keys ({_DEFAULTS.eviction_interval_secs}; 0 = never)",
    )
    group.add_argument(
        "--max-tree-size",
        type=int,
        default=_DEFAULTS.max_tree_size,
        metavar="UNITS",
        help="cache_aware: tokens (or characters) each engine's prefix tree keeps after a "
        f"trim ({_DEFAULTS.max_tree_size})",
    )
    group.add_argument(
        "--assignment-mode",
        choices=ASSIGNMENT_MODES,
        default=_DEFAULTS.assignment_mode,
        help="manual: where a routing key seen for the first time goes "
        f"({_DEFAULTS.assignment_mode})",
    )
    group.add_argument(
        "--max-idle-secs",
        type=int,
        default=_DEFAULTS.max_idle_secs,
        metavar="SECONDS",
        help=f"manual: forget routing keys unused this long ({_DEFAULTS.max_idle_secs}; 0 = never)",
    )
    group.add_argument(
        "--tie-break",
        choices=TIE_BREAKS,
        default=_DEFAULTS.tie_break,
        help="least_in_flight: among equally busy engines the lowest index (the rollout "
        f"router's rule) or each in turn ({_DEFAULTS.tie_break})",
    )
    group.add_argument(
        "--policy-seed",
        type=int,
        default=None,
        metavar="N",
        help="random, power_of_two, manual, consistent_hashing: seed of the random choices "
        "(default: from the OS)",
    )
    add_reliability_arguments(parser)


def engine_routing_settings(args: argparse.Namespace) -> EngineRoutingConfig:
    """The options as one validated config (SystemExit naming the problem)."""
    try:
        return EngineRoutingConfig(
            policy=args.policy,
            cache_threshold=args.cache_threshold,
            balance_abs_threshold=args.balance_abs_threshold,
            balance_rel_threshold=args.balance_rel_threshold,
            eviction_interval_secs=args.eviction_interval_secs,
            max_tree_size=args.max_tree_size,
            assignment_mode=args.assignment_mode,
            max_idle_secs=args.max_idle_secs,
            tie_break=args.tie_break,
            seed=args.policy_seed,
        )
    except ValueError as exc:
        raise SystemExit(f"engine routing: {exc}") from None


def engine_routing_argv(args: argparse.Namespace) -> list[str]:
    """These options as the argv of a router or worker process."""
    config = engine_routing_settings(args)
    argv = [
        "--policy",
        config.policy,
        "--cache-threshold",
        repr(config.cache_threshold),
        "--balance-abs-threshold",
        str(config.balance_abs_threshold),
        "--balance-rel-threshold",
        repr(config.balance_rel_threshold),
        "--eviction-interval-secs",
        str(config.eviction_interval_secs),
        "--max-tree-size",
        str(config.max_tree_size),
        "--assignment-mode",
        config.assignment_mode,
        "--max-idle-secs",
        str(config.max_idle_secs),
        "--tie-break",
        config.tie_break,
    ]
    if config.seed is not None:
        argv += ["--policy-seed", str(config.seed)]
    return argv + reliability_argv(args)


_RELIABILITY = ReliabilityConfig()


def add_reliability_arguments(parser: argparse.ArgumentParser) -> None:
    """Health thresholds, retries and the circuit breaker, with the SGLang Model Gateway's
    names and defaults (docs/reliability.md, "Engine-facing retries and the circuit
    breaker")."""
    d = _RELIABILITY
    group = parser.add_argument_group(
        "engine reliability (health thresholds, retries, circuit breaker; docs/reliability.md)"
    )
    group.add_argument(
        "--health-failure-threshold",
        type=int,
        default=d.health_failure_threshold,
        metavar="N",
        help="failed health probes in a row before an engine is marked down "
        f"({d.health_failure_threshold}; a request that cannot connect marks it down at once)",
    )
    group.add_argument(
        "--health-success-threshold",
        type=int,
        default=d.health_success_threshold,
        metavar="N",
        help="passed health probes in a row before a down engine is up again "
        f"({d.health_success_threshold})",
    )
    group.add_argument(
        "--health-check-timeout-secs",
        type=float,
        default=d.health_check_timeout_secs,
        metavar="SECONDS",
        help=f"each health probe's timeout ({d.health_check_timeout_secs:g})",
    )
    group.add_argument(
        "--health-check-endpoint",
        default=d.health_check_endpoint,
        metavar="PATH",
        help=f"the engines' health path ({d.health_check_endpoint})",
    )
    group.add_argument(
        "--retry-max-retries",
        type=int,
        default=d.retry_max_retries,
        metavar="N",
        help="attempts per request in all, the first included, when an engine could not be "
        f"connected to or answered 429 / 503 ({d.retry_max_retries})",
    )
    group.add_argument(
        "--retry-initial-backoff-ms",
        type=int,
        default=d.retry_initial_backoff_ms,
        metavar="MS",
        help=f"wait before the first retry ({d.retry_initial_backoff_ms})",
    )
    group.add_argument(
        "--retry-max-backoff-ms",
        type=int,
        default=d.retry_max_backoff_ms,
        metavar="MS",
        help=f"the longest wait between attempts ({d.retry_max_backoff_ms})",
    )
    group.add_argument(
        "--retry-backoff-multiplier",
        type=float,
        default=d.retry_backoff_multiplier,
        metavar="X",
        help=f"each wait is the previous one times this ({d.retry_backoff_multiplier})",
    )
    group.add_argument(
        "--retry-jitter-factor",
        type=float,
        default=d.retry_jitter_factor,
        metavar="RATIO",
        help=f"each wait moves randomly by up to this share of itself ({d.retry_jitter_factor})",
    )
    group.add_argument(
        "--disable-retries",
        action="store_true",
        help="send every request once: no retry after a connect error, 429 or 503",
    )
    group.add_argument(
        "--cb-failure-threshold",
        type=int,
        default=d.cb_failure_threshold,
        metavar="N",
        help="failures in a row (transport errors, 5xx replies) that open an engine's circuit "
        f"breaker, taking it out of rotation ({d.cb_failure_threshold})",
    )
    group.add_argument(
        "--cb-success-threshold",
        type=int,
        default=d.cb_success_threshold,
        metavar="N",
        help=f"trial successes in a row that close a half-open breaker ({d.cb_success_threshold})",
    )
    group.add_argument(
        "--cb-timeout-duration-secs",
        type=float,
        default=d.cb_timeout_duration_secs,
        metavar="SECONDS",
        help="how long an open breaker keeps its engine out before trial requests "
        f"({d.cb_timeout_duration_secs:g})",
    )
    group.add_argument(
        "--cb-window-duration-secs",
        type=float,
        default=d.cb_window_duration_secs,
        metavar="SECONDS",
        help=f"a failure streak older than this starts over ({d.cb_window_duration_secs:g})",
    )
    group.add_argument(
        "--disable-circuit-breaker",
        action="store_true",
        help="never take an engine out of rotation for its failures (health probes still do)",
    )


def reliability_settings(args: argparse.Namespace) -> ReliabilityConfig:
    """The reliability options as one validated config (SystemExit naming the problem)."""
    try:
        return ReliabilityConfig(
            health_failure_threshold=args.health_failure_threshold,
            health_success_threshold=args.health_success_threshold,
            health_check_timeout_secs=args.health_check_timeout_secs,
            health_check_endpoint=args.health_check_endpoint,
            retry_max_retries=args.retry_max_retries,
            retry_initial_backoff_ms=args.retry_initial_backoff_ms,
            retry_max_backoff_ms=args.retry_max_backoff_ms,
            retry_backoff_multiplier=args.retry_backoff_multiplier,
            retry_jitter_factor=args.retry_jitter_factor,
            disable_retries=args.disable_retries,
            cb_failure_threshold=args.cb_failure_threshold,
            cb_success_threshold=args.cb_success_threshold,
            cb_timeout_duration_secs=args.cb_timeout_duration_secs,
            cb_window_duration_secs=args.cb_window_duration_secs,
            disable_circuit_breaker=args.disable_circuit_breaker,
        )
    except ValueError as exc:
        raise SystemExit(f"engine reliability: {exc}") from None


def reliability_argv(args: argparse.Namespace) -> list[str]:
    """The reliability options as the argv of a router or worker process."""
    c = reliability_settings(args)
    argv = [
        "--health-failure-threshold",
        str(c.health_failure_threshold),
        "--health-success-threshold",
        str(c.health_success_threshold),
        "--health-check-timeout-secs",
        repr(c.health_check_timeout_secs),
        "--health-check-endpoint",
        c.health_check_endpoint,
        "--retry-max-retries",
        str(c.retry_max_retries),
        "--retry-initial-backoff-ms",
        str(c.retry_initial_backoff_ms),
        "--retry-max-backoff-ms",
        str(c.retry_max_backoff_ms),
        "--retry-backoff-multiplier",
        repr(c.retry_backoff_multiplier),
        "--retry-jitter-factor",
        repr(c.retry_jitter_factor),
        "--cb-failure-threshold",
        str(c.cb_failure_threshold),
        "--cb-success-threshold",
        str(c.cb_success_threshold),
        "--cb-timeout-duration-secs",
        repr(c.cb_timeout_duration_secs),
        "--cb-window-duration-secs",
        repr(c.cb_window_duration_secs),
    ]
    if c.disable_retries:
        argv.append("--disable-retries")
    if c.disable_circuit_breaker:
        argv.append("--disable-circuit-breaker")
    return argv

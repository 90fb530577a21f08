"""Command-line options of engine routing (`--policy` and its tunables), shared by `serve`,
the router process (the compiled front) and the worker processes (the Python proxy path):
declared once, validated once, forwarded as argv. The flag names are the SGLang Model
Gateway's, so its users can bring their command line (docs/routing.md, "Engine routing").
"""

from __future__ import annotations

import argparse

from sessiongate.engine_routing.config import (
    ASSIGNMENT_MODES,
    DEFAULT_POLICY,
    POLICIES,
    TIE_BREAKS,
    EngineRoutingConfig,
)

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
    return argv

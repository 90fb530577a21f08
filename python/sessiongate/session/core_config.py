"""What a session core is built from, as one typed object, and the command line that fills it.

Every layout builds its core the same way: parse the session options (`add_session_arguments`),
turn them into a `CoreConfig` (`core_config`, which validates), and hand that to
`session.factory.build_core`. `serve` validates once and starts its workers with
`session_argv`; a worker parses that argv with the same options, so both sides read every
option with one declaration. Import-light (no tokenizer, no core): the router and the CLI
import this too.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field

from sessiongate.engines.policy import EngineRoutingConfig
from sessiongate.engines.reliability import ReliabilityConfig
from sessiongate.engines.routing_options import (
    add_engine_routing_arguments,
    engine_routing_argv,
    engine_routing_settings,
    reliability_settings,
)
from sessiongate.session.core_options import (
    NO_BACKEND,
    add_core_arguments,
    check_session_routing,
    core_argv,
    core_settings,
)
from sessiongate.session.limit_options import add_limit_arguments, limit_argv, limit_settings
from sessiongate.session.settings import SessionSettings
from sessiongate.session.store.options import add_store_arguments, store_argv, store_settings
from sessiongate.session.store.records_store import StoreSettings
from sessiongate.session.tree_options import (
    add_session_mode_option,
    session_mode_argv,
    session_mode_settings,
)
from sessiongate.session.turn_options import add_turn_arguments, turn_argv, turn_settings


@dataclass(frozen=True)
class CoreRole:
    """Which core of a deployment this is: how limit errors name it, and which part of
    --records-dir it owns (`shard`: DIR/worker-N under a supervisor; None: DIR itself)."""

    label: str
    shard: int | None
    # Appended to "session not found": e.g. this worker replaced a lost one.
    not_found_note: str = ""


# `serve --workers 0`: the one core of the gateway.
IN_PROCESS = CoreRole("the gateway", 0)
# `sessiongate worker`: it does not know its shard index (the router's endpoint order does).
STANDALONE = CoreRole("this worker", None)


def supervised(index: int, not_found_note: str = "") -> CoreRole:
    """Worker `index` of `serve`'s supervisor (local process)."""
    return CoreRole(f"worker {index}", index, not_found_note)


@dataclass(frozen=True)
class CoreConfig:
    """Everything a session core needs to be built (session.factory.build_core)."""

    settings: SessionSettings
    backends: tuple[str, ...]
    timeout: float = 600.0
    health_interval: float = 5.0
    # Tokenizer directory (None: the built-in one) and a chat template file replacing its own.
    tokenizer: str | None = None
    chat_template_path: str | None = None
    # The session routing mode (None: no stamping) and its KEY=VALUE options.
    session_routing: str | None = None
    session_routing_opts: tuple[str, ...] = ()
    # Durable records (--records-dir), or None: in memory only.
    store: StoreSettings | None = None
    # Which engine a stateless request goes to (--policy and its tunables).
    engine_routing: EngineRoutingConfig = field(default_factory=EngineRoutingConfig)
    # Health thresholds, retries and the circuit breaker (--retry-*, --cb-*, --health-*).
    reliability: ReliabilityConfig = field(default_factory=ReliabilityConfig)


def add_session_arguments(parser: argparse.ArgumentParser, *, embedded_mock: bool) -> None:
    """Every option of a session core, for `serve` (`embedded_mock`: --backend defaults to
    the mock engine), `_worker` and `sessiongate worker`."""
    add_core_arguments(parser, embedded_mock=embedded_mock)
    add_turn_arguments(parser)
    add_session_mode_option(parser)
    add_limit_arguments(parser)
    add_store_arguments(parser)
    add_engine_routing_arguments(parser)


def core_config(
    args: argparse.Namespace,
    role: CoreRole,
    *,
    program: str,
    backends: Sequence[str] | None = None,
) -> CoreConfig:
    """The config of one core from its parsed options, validated (SystemExit naming the
    option; routing errors name `program`). `backends` replaces `args.backend` (serve's
    URLs once the embedded engine is up). Resolves defaults on `args` (--tito-model's roles
    and trim, the R3 top-k), so `session_argv` forwards the resolved values."""
    settings = SessionSettings(
        **core_settings(args),
        **turn_settings(args),
        **session_mode_settings(args),
        **limit_settings(args),
        label=role.label,
        not_found_note=role.not_found_note,
    )
    check_session_routing(args, program)
    return CoreConfig(
        settings=settings,
        # `--backend none` (a worker of a gateway whose engines register at run time).
        backends=tuple(
            [u for u in args.backend if u != NO_BACKEND] if backends is None else backends
        ),
        timeout=args.timeout,
        health_interval=args.health_interval,
        tokenizer=args.tokenizer,
        chat_template_path=args.chat_template_path,
        session_routing=args.session_routing,
        session_routing_opts=tuple(args.session_routing_opt),
        store=store_settings(args, role.shard),
        engine_routing=engine_routing_settings(args),
        reliability=reliability_settings(args),
    )


def session_argv(
    args: argparse.Namespace,
    backends: Sequence[str],
    *,
    local_workers: int,
    placed_elsewhere: bool = False,
) -> list[str]:
    """Every session option as the argv `serve` starts a worker with (after `core_config`).
    `local_workers` share this machine (memory budgets split over them, one records shard
    each); `placed_elsewhere` (Ray) leaves `auto` memory budgets to each worker's host."""
    return [
        *core_argv(args, backends),
        *turn_argv(args),
        *session_mode_argv(args),
        *limit_argv(args, None if placed_elsewhere else local_workers),
        *store_argv(args, local_workers),
        *engine_routing_argv(args),
    ]

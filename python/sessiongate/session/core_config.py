"""What a session core is built from, as one typed object, made from the gateway's
configuration.

Every layout builds its core the same way: take the `GatewayConfig` (config/), resolve and
check its sessions, limits and records sections (`core_config`), and hand the `CoreConfig`
to `session.factory.build_core`. `serve` resolves once and hands its workers the resolved
configuration (`worker_config`), so a worker learns nothing twice. Import-light (no
tokenizer, no core): the router and the CLI import this too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from sessiongate.config.engines import NO_BACKEND, EngineRoutingConfig, ReliabilityConfig
from sessiongate.config.gateway import GatewayConfig
from sessiongate.config.rl import DEFAULT_PAUSE_QUEUE, DEFAULT_PAUSE_WAIT_S
from sessiongate.session.core_options import check_session_routing, core_settings, engine_urls
from sessiongate.session.limit_options import limit_settings, limits_for_workers
from sessiongate.session.settings import SessionSettings
from sessiongate.session.store.options import records_for_workers, store_settings
from sessiongate.session.store.records_store import StoreSettings
from sessiongate.session.tree_options import session_mode_settings
from sessiongate.session.turn_options import prompt_encoder, resolve_sessions, turn_settings


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
    engine_urls: tuple[str, ...]
    timeout: float = 600.0
    health_interval: float = 5.0
    # Tokenizer directory (None: the built-in one) and a chat template file replacing its own.
    tokenizer: str | None = None
    chat_template_path: str | None = None
    # A family's Python prompt encoder instead of a template (DeepSeek: --tito-model).
    prompt_encoder: str | None = None
    # The SGLang version whose rendering rules the tokenizer follows (`auto`: asked of the
    # engines when the core is built; serve resolves it once for its workers).
    sglang_version: str = "auto"
    # The session routing mode (None: no stamping) and its KEY=VALUE options.
    session_routing: str | None = None
    session_routing_opts: tuple[str, ...] = ()
    # Durable records (--records-dir), or None: in memory only.
    store: StoreSettings | None = None
    # Which engine a stateless request goes to (--policy and its tunables).
    engine_routing: EngineRoutingConfig = field(default_factory=EngineRoutingConfig)
    # Health thresholds, retries and the circuit breaker (--retry-*, --cb-*, --health-*).
    reliability: ReliabilityConfig = field(default_factory=ReliabilityConfig)
    # Requests held while their engines are paused: how many, how long (--pause-*).
    pause_queue_size: int = DEFAULT_PAUSE_QUEUE
    pause_wait_secs: float = DEFAULT_PAUSE_WAIT_S


def core_config(
    config: GatewayConfig,
    role: CoreRole,
    *,
    program: str,
    engines: Sequence[str] | None = None,
) -> CoreConfig:
    """The config of one core, validated (SystemExit naming the option; routing errors
    name `program`). `engines` replaces the configured URLs (serve's, once the embedded
    engine is up)."""
    sessions = resolve_sessions(config.sessions)
    settings = SessionSettings(
        **core_settings(sessions),
        **turn_settings(sessions),
        **session_mode_settings(sessions),
        **limit_settings(config.limits),
        label=role.label,
        not_found_note=role.not_found_note,
    )
    check_session_routing(config.session_routing, program)
    urls = engine_urls(config.engines, embedded_mock=False) if engines is None else engines
    return CoreConfig(
        settings=settings,
        engine_urls=tuple(urls),
        timeout=config.engines.timeout,
        health_interval=config.engines.health_interval,
        tokenizer=sessions.tokenizer,
        chat_template_path=sessions.chat_template_path,
        prompt_encoder=prompt_encoder(sessions),
        sglang_version=sessions.sglang_version,
        session_routing=config.session_routing.mode,
        session_routing_opts=tuple(config.session_routing.options),
        store=store_settings(config.records, role.shard),
        engine_routing=config.engines.routing,
        reliability=config.engines.reliability,
        pause_queue_size=config.rl.pause_queue_size,
        pause_wait_secs=config.rl.pause_wait_secs,
    )


def worker_config(
    config: GatewayConfig,
    engines: Sequence[str],
    *,
    local_workers: int,
    placed_elsewhere: bool = False,
) -> GatewayConfig:
    """The configuration `serve` hands each worker (after `core_config` checked it):
    sessions resolved, the engines it talks to (`none` when they register at run time).
    `local_workers` share this machine (memory budgets split over them, one records shard
    each); `placed_elsewhere` (Ray) leaves `auto` memory budgets to each worker's host."""
    return config.replace(
        engines=dataclasses.replace(config.engines, urls=tuple(engines) or (NO_BACKEND,)),
        sessions=resolve_sessions(config.sessions),
        limits=limits_for_workers(config.limits, None if placed_elsewhere else local_workers),
        records=records_for_workers(config.records, local_workers),
    )

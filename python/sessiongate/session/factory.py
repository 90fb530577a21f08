"""The one place a session core is built: every layout (in-process, local worker, TCP
worker, each Ray actor's worker) calls `build_core` with a `CoreConfig`, so a core never
misses its stamper, its store or its recovery depending on who started it."""

from __future__ import annotations

import sys

from sessiongate.config.fields import flag_of
from sessiongate.config.sessions import SessionsConfig
from sessiongate.engines.engine_versions import choose_sglang_version
from sessiongate.engines.pool import EnginePool
from sessiongate.session.core import SessionCore
from sessiongate.session.core_config import CoreConfig
from sessiongate.session.store.records_store import RecordsStore
from sessiongate.session_routing import load_mode
from sessiongate.session_routing.stamper import SessionStamper
from sessiongate.sglang_rules import rules_for
from sessiongate.tokenizer import ChatTokenizer, load_tokenizer


def build_core(config: CoreConfig, *, tokenizer: ChatTokenizer | None = None) -> SessionCore:
    """One session core and its upstream pool, its records recovered. `tokenizer`: one
    already loaded (an embedding app's), instead of loading `config.tokenizer`."""
    # core_config validated the mode already; a failure here is a bug, so let it raise.
    mode = load_mode(config.session_routing, config.session_routing_opts)
    core = SessionCore(
        tokenizer if tokenizer is not None else _load_tokenizer(config),
        EnginePool(
            list(config.engine_urls),
            timeout=config.timeout,
            health_interval=config.health_interval,
            engine_routing=config.engine_routing,
            reliability=config.reliability,
            pause_queue_size=config.pause_queue_size,
            pause_wait_secs=config.pause_wait_secs,
            # `--backend none`: engines register at run time (engines/registry.py).
            allow_empty=True,
        ),
        config.settings,
        SessionStamper(mode) if mode is not None else None,
        RecordsStore(config.store) if config.store is not None else None,
    )
    # Before the caller serves anything: a worker is ready only with its shard recovered.
    report = core.recover()
    if report is not None and (report.sessions or report.torn_tails or report.dropped_files):
        directory = config.store.directory if config.store is not None else ""
        print(
            f"{config.settings.label}: recovered {report.sessions} sessions, {report.turns} "
            f"turns, {report.bytes / 2**20:.1f} MiB from {directory} in "
            f"{report.seconds:.2f} s ({report.torn_tails} torn tails dropped)",
            file=sys.stderr,
            flush=True,
        )
    return core


def _load_tokenizer(config: CoreConfig) -> ChatTokenizer:
    """The configured tokenizer, rendering by the rules of the configured SGLang version;
    `auto` (a core started by itself: `sessiongate worker`, an embedding app) asks its
    engines now, as serve does for the workers it starts (engines/engine_versions.py)."""
    version = config.sglang_version
    if version == "auto":
        flag = flag_of(SessionsConfig, "sglang_version")
        try:
            choice = choose_sglang_version(version, config.engine_urls, flag=flag)
        except ValueError as exc:
            raise SystemExit(f"{config.settings.label}: {exc}") from None
        print(f"{config.settings.label}: prompts render by {choice.line}", file=sys.stderr)
        version = choice.version
    return load_tokenizer(
        config.tokenizer,
        chat_template_path=config.chat_template_path,
        prompt_encoder=config.prompt_encoder,
        sglang_rules=rules_for(version),
    )

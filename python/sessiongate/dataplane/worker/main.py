"""`sessiongate _worker`: one session worker process on an inherited channel socket.

Started by the supervisor (spawned, never forked) with the socket's fd; it owns exactly one
session core and one upstream client, and exits when the router closes the channel or the
supervisor dies.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING, Any

from sessiongate.engine_routing.options import (
    add_engine_routing_arguments,
    engine_routing_settings,
)
from sessiongate.process.children import die_with_parent
from sessiongate.process.memory import keep_freed_records_warm
from sessiongate.session.limit_options import add_limit_arguments, limit_settings
from sessiongate.session.store.options import add_store_arguments, store_settings
from sessiongate.session.tree_options import add_session_mode_option, session_mode_settings
from sessiongate.session.turn_options import add_turn_arguments, apply_tito_model, turn_settings

if TYPE_CHECKING:
    from sessiongate.session.core import SessionCore

logger = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = sub.add_parser("_worker")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--generation", type=int, default=0)
    add_session_arguments(parser)
    parser.set_defaults(run=run)


def add_session_arguments(parser: argparse.ArgumentParser) -> None:
    """The session options of a worker: shared by `_worker` and `sessiongate worker`."""
    parser.add_argument(
        "--backend",
        action="append",
        required=True,
        help="upstream base URL (an SGLang-style engine or router); repeat for several",
    )
    parser.add_argument(
        "--health-interval",
        type=float,
        default=5.0,
        help="seconds between upstream health checks (GET /health; 5)",
    )
    parser.add_argument(
        "--tokenizer", default=None, help="local Hugging Face tokenizer directory (built-in)"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="upstream timeout (600 s)")
    parser.add_argument(
        "--allowed-append-roles",
        default=None,
        help="roles an agent may append after an assistant turn (--tito-model's, else tool,user)",
    )
    parser.add_argument(
        "--max-trim-tokens",
        type=int,
        default=None,
        help="trailing checkpoint tokens allowed to differ in the next turn (--tito-model's, "
        "else 0)",
    )
    parser.add_argument(
        "--header-session-ttl",
        type=float,
        default=3600.0,
        help="close header-created sessions after this many idle seconds (3600; 0 = never)",
    )
    parser.add_argument(
        "--session-routing", default=None, metavar="MODE", help="session routing mode"
    )
    parser.add_argument(
        "--session-routing-opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of the session routing mode (repeatable)",
    )
    parser.add_argument("--log-level", default="warning")
    add_turn_arguments(parser)
    add_session_mode_option(parser)
    add_limit_arguments(parser)
    add_store_arguments(parser)
    add_engine_routing_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if not die_with_parent():
        return 0
    logging.basicConfig(
        level=args.log_level.upper(), format=f"worker {args.index}: %(levelname)s %(message)s"
    )
    keep_freed_records_warm()
    sock = socket.socket(fileno=args.fd)
    try:
        reason = asyncio.run(_main(args, sock))
    except KeyboardInterrupt:
        reason = "interrupted"
    logger.info("exiting: %s", reason)
    return 0


def restart_note(index: int) -> str:
    """Appended to 404s for unknown sessions by a worker that replaced a lost one."""
    return (
        f" (worker {index} was restarted at {time.strftime('%H:%M:%S')}; sessions it "
        "held before were lost with the previous worker process)"
    )


def build_core(args: argparse.Namespace, not_found_note: str = "") -> SessionCore:
    """One session core and its upstream pool from the session options."""
    # Heavy imports live here: this module is also imported by the CLI of light processes.
    from sessiongate.session.core import SessionCore
    from sessiongate.session.settings import SessionSettings
    from sessiongate.session.store.records_store import RecordsStore
    from sessiongate.session_routing import load_mode
    from sessiongate.session_routing.stamper import SessionStamper
    from sessiongate.tokenizer import load_tokenizer
    from sessiongate.upstream import UpstreamPool

    apply_tito_model(args)
    settings = SessionSettings(
        allowed_append_roles=frozenset(
            r.strip() for r in args.allowed_append_roles.split(",") if r.strip()
        ),
        max_trim_tokens=args.max_trim_tokens,
        header_session_ttl=args.header_session_ttl,
        not_found_note=not_found_note,
        **turn_settings(args),
        **session_mode_settings(args),
        **limit_settings(args),
        label=_core_label(args),
    )
    # The caller validated the mode already; a failure here is a bug, so let it raise.
    mode = load_mode(args.session_routing, args.session_routing_opt)
    store_config = store_settings(args, _store_index(args))
    core = SessionCore(
        load_tokenizer(args.tokenizer, chat_template_path=args.chat_template_path),
        UpstreamPool(
            args.backend,
            timeout=args.timeout,
            health_interval=args.health_interval,
            engine_routing=engine_routing_settings(args),
        ),
        settings,
        SessionStamper(mode) if mode is not None else None,
        RecordsStore(store_config) if store_config is not None else None,
    )
    # Before the caller serves anything: a worker is ready only with its shard recovered.
    report = core.recover()
    if report is not None and (report.sessions or report.torn_tails or report.dropped_files):
        print(
            f"{settings.label}: recovered {report.sessions} sessions, {report.turns} turns, "
            f"{report.bytes / 2**20:.1f} MiB from {store_config.directory if store_config else ''}"
            f" in {report.seconds:.2f} s ({report.torn_tails} torn tails dropped)",
            file=sys.stderr,
            flush=True,
        )
    return core


def _store_index(args: argparse.Namespace) -> int | None:
    """The shard whose directory a core uses: a supervised worker's index, 0 in-process,
    None for a standalone `sessiongate worker` (it owns its --records-dir)."""
    if getattr(args, "index", None) is not None:
        return int(args.index)
    return None if getattr(args, "listen", None) else 0


def _core_label(args: argparse.Namespace) -> str:
    """How limit errors name the core: by the router's worker index; a standalone worker
    does not know its shard index (the router's --worker-endpoints order fixes it)."""
    if getattr(args, "index", None) is not None:
        return f"worker {args.index}"
    if getattr(args, "listen", None):
        return "this worker"
    return "the gateway"


def core_status(core: SessionCore) -> dict[str, Any]:
    """The core's part of each heartbeat."""
    return {
        "sessions": len(core.sessions),
        "turns_recorded": core.turns_recorded,
        "turns_aborted": core.turns_aborted,
        "r3_missing_turns": core.r3_missing_turns,
        "relay_buffered_turns": core.relay_buffered_turns,
        "affinity_hits": core.upstream.affinity_hits,
        "repins": core.upstream.repins,
        "sessions_ended": core.stamper.ended if core.stamper else 0,
        # The router reports these per worker in /health and as sessiongate_upstream_up.
        "upstream": "down" if core.upstream.all_down else "ok",
        "upstreams": core.upstream.upstream_states(),
        # Limits and their usage: the router shows them per worker in /health and /metrics.
        **core.limits_status(),
    }


async def _main(args: argparse.Namespace, sock: socket.socket) -> str:
    from sessiongate.dataplane.transport.connection import FrameConnection
    from sessiongate.dataplane.worker.loop import WorkerLoop

    # Without a records directory a replacement worker starts empty: its 404s say why.
    lost = args.generation > 0 and not args.records_dir
    core = build_core(args, restart_note(args.index) if lost else "")
    # Probe the upstreams from the start, not from the first request: /health must say the
    # engine is down even when no traffic has come yet.
    core.start()
    conn = await FrameConnection(sock).open()
    loop = WorkerLoop(
        conn,
        core.handle,
        index=args.index,
        generation=args.generation,
        status=lambda: core_status(core),
    )
    serving = asyncio.create_task(loop.run())
    stop = asyncio.Event()
    event_loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        event_loop.add_signal_handler(sig, stop.set)
    stopper = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({serving, stopper}, return_when=asyncio.FIRST_COMPLETED)
    reason = serving.result() if serving in done else "signalled"
    serving.cancel()
    stopper.cancel()
    conn.close()
    await core.aclose()
    print(f"worker {args.index} stopped: {reason}", file=sys.stderr, flush=True)
    return reason

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

from sessiongate.process.children import die_with_parent

logger = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = sub.add_parser("_worker")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--generation", type=int, default=0)
    parser.add_argument("--backend", action="append", required=True)
    parser.add_argument("--health-interval", type=float, default=5.0)
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--r3", action="store_true")
    parser.add_argument("--r3-topk", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--allowed-append-roles", default="tool,user")
    parser.add_argument("--max-trim-tokens", type=int, default=0)
    parser.add_argument("--header-session-ttl", type=float, default=3600.0)
    parser.add_argument("--session-routing", default=None)
    parser.add_argument("--session-routing-opt", action="append", default=[])
    parser.add_argument("--log-level", default="warning")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if not die_with_parent():
        return 0
    logging.basicConfig(
        level=args.log_level.upper(), format=f"worker {args.index}: %(levelname)s %(message)s"
    )
    sock = socket.socket(fileno=args.fd)
    try:
        reason = asyncio.run(_main(args, sock))
    except KeyboardInterrupt:
        reason = "interrupted"
    logger.info("exiting: %s", reason)
    return 0


async def _main(args: argparse.Namespace, sock: socket.socket) -> str:
    # Heavy imports live here: this module is also imported by the CLI of light processes.
    from sessiongate.dataplane.connection import FrameConnection
    from sessiongate.dataplane.worker_loop import WorkerLoop
    from sessiongate.routing import load_mode
    from sessiongate.routing.stamper import SessionStamper
    from sessiongate.session.core import SessionCore
    from sessiongate.session.settings import SessionSettings
    from sessiongate.tokenizer import load_tokenizer
    from sessiongate.upstream import UpstreamPool

    note = ""
    if args.generation > 0:
        note = (
            f" (worker {args.index} was restarted at {time.strftime('%H:%M:%S')}; sessions it "
            "held before were lost with the previous worker process)"
        )
    settings = SessionSettings(
        allowed_append_roles=frozenset(
            r.strip() for r in args.allowed_append_roles.split(",") if r.strip()
        ),
        max_trim_tokens=args.max_trim_tokens,
        r3=args.r3,
        r3_topk=args.r3_topk,
        header_session_ttl=args.header_session_ttl,
        not_found_note=note,
    )
    # The supervisor validated the mode already; a failure here is a bug, so let it raise.
    mode = load_mode(args.session_routing, args.session_routing_opt)
    core = SessionCore(
        load_tokenizer(args.tokenizer),
        UpstreamPool(args.backend, timeout=args.timeout, health_interval=args.health_interval),
        settings,
        SessionStamper(mode) if mode is not None else None,
    )
    conn = await FrameConnection(sock).open()
    loop = WorkerLoop(
        conn,
        core.handle,
        index=args.index,
        generation=args.generation,
        status=lambda: {
            "sessions": len(core.sessions),
            "turns_recorded": core.turns_recorded,
            "affinity_hits": core.upstream.affinity_hits,
            "repins": core.upstream.repins,
            "sessions_ended": core.stamper.ended if core.stamper else 0,
        },
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

"""`sessiongate _worker`: one session worker process on an inherited channel socket.

Started by the supervisor (spawned, never forked) with its launch document in the
environment (config/launch.py: the resolved configuration, the socket's fd, its index); it
owns exactly one session core and one engine client, and exits when the router closes the
channel or the supervisor dies. A launch without a descriptor (a Ray actor's worker) runs
the TCP worker of `sessiongate worker` instead.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from typing import TYPE_CHECKING

from sessiongate.config.launch import WorkerLaunch, read_launch
from sessiongate.dataplane.worker.status import core_status, restart_note
from sessiongate.process.children import die_with_parent
from sessiongate.process.memory import keep_freed_records_warm
from sessiongate.session.core_config import core_config, supervised

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("_worker")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    launch: WorkerLaunch = read_launch(WorkerLaunch)
    if launch.fd is None:
        from sessiongate.dataplane.worker.server import serve_tcp_worker

        return serve_tcp_worker(launch.config)
    if not die_with_parent():
        return 0
    logging.basicConfig(
        level=launch.config.log_level.upper(),
        format=f"worker {launch.index}: %(levelname)s %(message)s",
    )
    keep_freed_records_warm()
    sock = socket.socket(fileno=launch.fd)
    try:
        reason = asyncio.run(_main(launch, sock))
    except KeyboardInterrupt:
        reason = "interrupted"
    logger.info("exiting: %s", reason)
    return 0


async def _main(launch: WorkerLaunch, sock: socket.socket) -> str:
    from sessiongate.dataplane.transport.connection import FrameConnection
    from sessiongate.dataplane.worker.loop import WorkerLoop
    from sessiongate.session.factory import build_core

    # Without a records directory a replacement worker starts empty: its 404s say why.
    lost = launch.generation > 0 and not launch.config.records.dir
    role = supervised(launch.index, restart_note(launch.index) if lost else "")
    # serve validated these options before starting its workers.
    core = build_core(core_config(launch.config, role, program="sessiongate serve"))
    # Probe the upstreams from the start, not from the first request: /health must say the
    # engine is down even when no traffic has come yet.
    core.start()
    conn = await FrameConnection(sock).open()
    loop = WorkerLoop(
        conn,
        core.handle,
        index=launch.index,
        generation=launch.generation,
        status=lambda: core_status(core),
        reply_dir=launch.reply_dir,
        lend_replies=launch.config.workers.lent_replies,
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
    print(f"worker {launch.index} stopped: {reason}", file=sys.stderr, flush=True)
    return reason

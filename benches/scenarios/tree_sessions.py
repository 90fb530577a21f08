"""Tree mode vs linear mode on the same workload (docs/trajectory-trees.md, "Figures"): CPU
per turn and memory per stored byte of the session core.

    python benches/scenarios/tree_sessions.py                       # ~3 min
    python benches/scenarios/tree_sessions.py --rounds 5 --turns 12 # a smoke run
    python benches/scenarios/tree_sessions.py --url http://HOST:PORT  # an engine already running

Two in-process SessionCores (the `serve --workers 0` core), one per mode, drive a mock engine
on loopback (started here unless --url is given; R3 on, 8 layers x top-2). CPU: the same
turn is sent to both cores back to back (order alternating), one turn at a time, and the
event-loop thread's CPU time around each `handle` call is summed per mode (the engine is
another process; replies this size are handled on the loop). Interleaving turn by turn makes
the machine's load hit both modes alike, so the ratio is stable where absolute figures move
with the load (printed). Memory: per mode alone, tracemalloc's retained bytes after the
workload, sessions alive, divided by the records' bytes (request + response bodies).

Workloads, the same requests in both modes:
  loop   tool loops, each turn extending the last one;
  retry  tool loops where every 4th turn is re-sent once with another seed (linear: a
         one-step rollback that replaces the record; tree: a sibling that keeps it).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import tracemalloc
import urllib.request
from typing import Any

from sessiongate.engines.pool import EnginePool
from sessiongate.protocol import CoreRequest
from sessiongate.session.core import SessionCore
from sessiongate.session.settings import SessionMode, SessionSettings
from sessiongate.tokenizer import load_tokenizer


async def call(
    core: SessionCore, op: str, sid: str | None, body: Any = None
) -> tuple[bytes, float]:
    """The reply body and the loop thread's CPU seconds the call took."""
    raw = b"" if body is None else json.dumps(body).encode()
    request = CoreRequest(
        op=op,
        session_id=sid,
        path="/v1/chat/completions",
        method="POST",
        headers=[("content-type", "application/json")],
        body=raw,
    )
    started = time.thread_time()
    reply = await core.handle(request)
    spent = time.thread_time() - started
    assert reply.status in (200, 204), (reply.status, reply.body[:300])
    return reply.body, spent


class Session:
    """One session's conversation, driven turn by turn on a core."""

    def __init__(self, core: SessionCore, index: int) -> None:
        self.core = core
        self.index = index
        self.sid = ""
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": f"task {index}"},
        ]

    async def open(self) -> None:
        body, _ = await call(self.core, "create", None)
        self.sid = json.loads(body)["session_id"]

    async def turn(self, turn: int, retry: bool) -> tuple[int, float]:
        """Turns sent and the CPU they took."""
        body = {"messages": self.messages, "max_tokens": 64, "seed": turn}
        reply, spent = await call(self.core, "chat", self.sid, body)
        sent = 1
        if retry and turn % 4 == 3:
            reply, more = await call(self.core, "chat", self.sid, {**body, "seed": 1000 + turn})
            spent += more
            sent += 1
        message = json.loads(reply)["choices"][0]["message"]
        self.messages = [*self.messages, message, {"role": "tool", "content": f"r{turn}"}]
        return sent, spent


def new_core(url: str, mode: SessionMode) -> SessionCore:
    settings = SessionSettings(session_mode=mode, r3=True, r3_topk=2)
    return SessionCore(load_tokenizer(None), EnginePool([url], timeout=60), settings)


async def cpu_ab(url: str, sessions: int, turns: int, retry: bool) -> dict[str, float]:
    """CPU per turn of both modes on the same turns, interleaved turn by turn."""
    cores = {mode: new_core(url, mode) for mode in MODES}
    spent = dict.fromkeys(MODES, 0.0)
    sent = dict.fromkeys(MODES, 0)
    for index in range(sessions):
        pair = {mode: Session(cores[mode], index) for mode in MODES}
        for session in pair.values():
            await session.open()
        for turn in range(turns):
            order = MODES if (index + turn) % 2 == 0 else MODES[::-1]
            for mode in order:
                count, cpu = await pair[mode].turn(turn, retry)
                sent[mode] += count
                spent[mode] += cpu
    for core in cores.values():
        await core.aclose()
    return {mode: spent[mode] / sent[mode] * 1e6 for mode in MODES}


async def memory(
    url: str, mode: SessionMode, sessions: int, turns: int, retry: bool
) -> dict[str, float]:
    """Retained bytes per record byte of one mode alone."""
    core = new_core(url, mode)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for index in range(sessions):
        session = Session(core, index)
        await session.open()
        for turn in range(turns):
            await session.turn(turn, retry)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    result = {
        "records_bytes": core.records_bytes,
        "held_bytes": held,
        "held_per_record_byte": held / core.records_bytes,
    }
    await core.aclose()
    return result


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start_engine() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    args = ["--completion-tokens", "24", "--completion-tokens-jitter", "8"]
    args += ["--r3-layers", "8", "--r3-topk", "2", "--port", str(port)]
    engine = subprocess.Popen(
        [sys.executable, "-m", "sessiongate", "mock-engine", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url + "/health", timeout=1).read()
            return engine, url
        except OSError:
            time.sleep(0.1)
    engine.kill()
    raise SystemExit("the mock engine did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="an SGLang-style engine already running")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    engine = None
    if args.url is None:
        engine, args.url = start_engine()
    try:
        run(args)
    finally:
        if engine is not None:
            engine.terminate()
            engine.wait(10)


def run(args: argparse.Namespace) -> None:
    print(f"load average before: {os.getloadavg()}")
    for retry in (False, True):
        name = "retry" if retry else "loop"
        rounds = [
            asyncio.run(cpu_ab(args.url, args.sessions, args.turns, retry))
            for _ in range(args.rounds)
        ]
        ratios = [r["tree"] / r["linear"] for r in rounds]
        lin = statistics.median(r["linear"] for r in rounds)
        tre = statistics.median(r["tree"] for r in rounds)
        print(f"{name}: {args.sessions} sessions x {args.turns} turns, {args.rounds} rounds")
        print(
            f"  CPU per turn (medians): linear {lin:.0f} us, tree {tre:.0f} us; tree/linear "
            f"per round {[round(x, 3) for x in ratios]}, median {statistics.median(ratios):.3f}"
        )
        mem = {
            mode: asyncio.run(memory(args.url, mode, args.sessions, args.turns, retry))
            for mode in MODES
        }
        for mode in MODES:
            m = mem[mode]
            print(
                f"  {mode}: records {m['records_bytes'] / 2**20:.2f} MiB, held "
                f"{m['held_bytes'] / 2**20:.2f} MiB, {m['held_per_record_byte']:.3f} bytes "
                "per record byte"
            )
        ratio = mem["tree"]["held_per_record_byte"] / mem["linear"]["held_per_record_byte"]
        print(f"  memory per stored byte, tree/linear: {ratio:.3f}")
    print(f"load average after: {os.getloadavg()}")


MODES: tuple[SessionMode, SessionMode] = ("linear", "tree")


if __name__ == "__main__":
    main()

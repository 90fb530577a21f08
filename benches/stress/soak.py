"""Soak: many concurrent sessions at a steady request rate for minutes, then every session
deleted; is anything leaking or drifting?

    python benches/stress/soak.py  # 1000 sessions, 10 min, then 2 min R3
    python benches/stress/soak.py --sessions 200 --minutes 2 --r3-minutes 1  # a shorter run

`serve --workers 2` with its embedded mock engine. Each session is an agent tool loop
(turn, tool result, turn, ...); turns are paced so the whole gateway sees `--rate` turns/s.
Phase 1 runs without R3, phase 2 on a second gateway with R3 (`--r3`, 48 layers x top-8).
Per phase, after a 15 s warm-up whose sessions are deleted, it reports errors by status,
turn latency p50/p99 of the first and of the last minute, router and worker RSS and open
file descriptors before the phase and after every session was deleted. Figures go to
docs/reliability.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scenarios"))
from e2e_dataplane import gateway, pct, process_roles, rss_mib

from sessiongate.http.client import HttpClient


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def snapshot(roles: dict[str, list[int]]) -> dict[str, Any]:
    pids = {
        "router": roles["router"][0],
        **{f"worker{i}": p for i, p in enumerate(roles["workers"])},
    }
    return {
        name: {"rss_mib": round(rss_mib(pid), 1), "fds": fd_count(pid)}
        for name, pid in pids.items()
    }


async def run_phase(url: str, sessions: int, seconds: float, rate: float) -> dict[str, Any]:
    # The lean client: httpx costs the driver a core at 100 turns/s over 1000 sessions and
    # its queueing then shows up as the gateway's latency.
    client = HttpClient()
    headers = {"content-type": "application/json"}

    async def call(method: str, path: str, document: object = None) -> tuple[int, bytes]:
        body = None if document is None else json.dumps(document).encode()
        async with client.request(method, url + path, headers=headers, body=body) as reply:
            return reply.status, await reply.read()

    started = time.monotonic()
    cpu_before = time.process_time()
    stop_at = started + seconds
    latencies: list[tuple[float, float]] = []  # (seconds since start, latency)
    statuses: Counter[int] = Counter()
    interval = sessions / rate  # each session's pause between its turns
    sids: list[str] = []
    for _ in range(sessions):
        status, body = await call("POST", "/sessions", {})
        statuses[status] += 1
        sids.append(json.loads(body)["session_id"])

    async def agent(index: int, sid: str) -> None:
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are an agent."},
            {"role": "user", "content": f"task {index}"},
        ]
        # Spread the sessions' first turns over one interval: a steady rate from the start.
        await asyncio.sleep(interval * index / sessions)
        turn = 0
        while time.monotonic() < stop_at:
            begun = time.monotonic()
            status, body = await call(
                "POST",
                f"/sessions/{sid}/v1/chat/completions",
                {"messages": messages, "max_tokens": 64},
            )
            latencies.append((begun - started, time.monotonic() - begun))
            statuses[status] += 1
            if status == 200:
                message = json.loads(body)["choices"][0]["message"]
                messages.append({k: v for k, v in message.items() if v is not None})
                messages.append({"role": "tool", "content": f"result {turn}"})
                turn += 1
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - begun)))

    await asyncio.gather(*(agent(i, sid) for i, sid in enumerate(sids)))
    before_delete = time.monotonic()
    for sid in sids:
        statuses[(await call("DELETE", f"/sessions/{sid}"))[0]] += 1
    delete_s = time.monotonic() - before_delete
    await client.aclose()
    first = [lat for at, lat in latencies if at < 60]
    last = [lat for at, lat in latencies if at >= seconds - 60]
    turns = len(latencies)

    def ms(values: list[float]) -> dict[str, float]:
        return {"p50": round(1000 * pct(values, 0.5), 1), "p99": round(1000 * pct(values, 0.99), 1)}

    return {
        "turns": turns,
        "turns_per_s": round(turns / seconds, 1),
        "statuses": dict(statuses),
        "errors": sum(n for status, n in statuses.items() if status >= 400),
        "first_minute_ms": ms(first),
        "last_minute_ms": ms(last),
        # p99 of each minute, to see when a drift starts.
        "p99_by_minute_ms": [
            ms(window)["p99"]
            for minute in range(int(seconds // 60))
            if (window := [lat for at, lat in latencies if minute * 60 <= at < minute * 60 + 60])
        ],
        "delete_all_s": round(delete_s, 1),
        "driver_cpu_share": round((time.process_time() - cpu_before) / seconds, 2),
    }


# Workers give freed memory back once they have had no request for 10 s
# (process/memory.py): snapshots after the deletes wait that long and a little more.
SETTLE_S = 12


def soak(label: str, args: argparse.Namespace, minutes: float, *extra: str) -> dict[str, Any]:
    with gateway("--workers", "2", *extra) as gw:
        roles = process_roles(gw)
        # Warm-up (lazy imports, caches, allocator arenas), deleted: then the baseline.
        asyncio.run(run_phase(gw.url, min(50, args.sessions), 15, args.rate / 2))
        time.sleep(SETTLE_S)
        start = snapshot(roles)
        figures = asyncio.run(run_phase(gw.url, args.sessions, 60 * minutes, args.rate))
        time.sleep(SETTLE_S)  # let the workers finish closing and trim
        after = snapshot(roles)
        # More rounds of the same load on the same gateway: memory that keeps growing round
        # after round is a leak; memory that settles is the allocator's high-water mark.
        later = []
        for _ in range(args.repeat):
            asyncio.run(run_phase(gw.url, args.sessions, 60 * minutes, args.rate))
            time.sleep(SETTLE_S)
            later.append(snapshot(roles))
        health = httpx.get(gw.url + "/health").json()
    return {
        "phase": label,
        **figures,
        "start": start,
        "after_deletes": after,
        "after_deletes_of_repeats": later,
        "sessions_left": health["sessions"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--r3-minutes", type=float, default=2.0)
    parser.add_argument("--rate", type=float, default=100.0, help="turns/s over the gateway")
    parser.add_argument(
        "--repeat", type=int, default=0, help="run each phase again N times on the same gateway"
    )
    args = parser.parse_args()
    print(json.dumps(soak("no R3", args, args.minutes)), flush=True)
    if args.r3_minutes > 0:
        r3 = ("--r3", "--mock-args", "--r3-layers 48 --r3-topk 8")
        print(json.dumps(soak("R3", args, args.r3_minutes, *r3)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where the gateway's CPU goes, part by part, against the copy floor measured in the same run.

    python benches/scenarios/cpu_parts.py            # 4 sessions x 5 R3 turns, 5 rounds
    python benches/scenarios/cpu_parts.py --quick    # 1 round (a smoke run)
    python benches/scenarios/cpu_parts.py --workers 0  # the in-process layout
    python benches/scenarios/cpu_parts.py --cold-start # and nothing touched at start
    python benches/scenarios/cpu_parts.py --files      # and GETs through files, not lent

One `serve --workers 1 --r3` gateway per configuration (the Rust core, and the pure-Python
twins with SESSIONGATE_IMPL=python), each with its embedded mock engine (R3 64 layers x
top-32, 64 new tokens: ~22-25 MiB of base64 R3 per turn, 2,000-word first prompts). Each
round runs, on every gateway in alternating order: 4 concurrent sessions x 5 turns, then one
GET of each session's records, then the deletes. Per part, CPU (utime + stime from /proc):

- `front`: the compiled front's threads (`sg-front`, and `sg-bulk` that `sendfile`s file
  parts) in the router process; a records GET's body the worker writes itself, on the
  connection the front lends it (docs/ipc.md, "Lent connections");
- `router`: the rest of the router process (its Python event loop and whatever it relays);
- `worker`: the worker process (the turn, the record, the GET's render).

With `--workers 0` there is one gateway process: `front` (its `sg-front` and `sg-bulk` threads) and
`gateway` (the rest: the session core and its HTTP server).

Figures: CPU ms per R3 turn per part (the turn phase), CPU ms per MiB of records GET per part
(the GET phase), the whole rollout's CPU (turns and GET, every part) of the twins over the
Rust core's, medians over the counted rounds (a first round warms each gateway; its CPU
per turn, all parts together, is reported as the cold first sessions'). Each gateway's CPU
from its start to its first round, a few seconds after it answers, is `start_cpu_ms_total`:
with `--r3` a gateway touches its warm records memory at start (`--warm-records-bytes`).
`--cold-start` adds the Rust core with `--warm-records-bytes 0`, which touches nothing: the
first sessions then pay the first touch of their records. `--files` adds the Rust core with
`--no-lent-replies`: its GETs go through shared-memory files, `sendfile`d by the front.

The copy floor, on the same machine in the same run: `memcpy` (copying a warm buffer of one
GET's size in user space) and `socket hop` (the bytes sent over a loopback TCP connection and
received into a reused buffer, both ends counted: what the kernel charges at least for a
process that receives bytes and sends them on). The per-turn floor is the turn's bytes (the
records GET's bytes over the turns: each turn's reply is received once) at the socket hop's
cost. docs/performance.md, "Records at copy speed", has the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_dataplane import process_roles, session_turns

from support.procs import ServerProcess, free_port

MOCK = "--r3-layers 64 --r3-topk 32 --completion-tokens 64 --completion-tokens-jitter 0"
SESSIONS, TURNS = 4, 5
# The compiled front's runtime threads and its bulk sender (file parts' sendfile).
FRONT_THREADS = ("sg-front", "sg-bulk")
MIB = 1 << 20
TICK = os.sysconf("SC_CLK_TCK")


def _task_cpu(stat: str) -> float:
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def process_cpu(pid: int) -> float:
    return _task_cpu(Path(f"/proc/{pid}/stat").read_text())


def thread_cpu(pid: int, names: tuple[str, ...]) -> float:
    """CPU seconds of the process's live threads with one of `names`."""
    total = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "comm").read_text().strip() in names:
                total += _task_cpu((task / "stat").read_text())
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return total


def has_threads(pid: int, names: tuple[str, ...]) -> bool:
    """Whether the process runs a thread named one of `names` (the compiled front's: with
    lent replies it may spend less than a clock tick in a round)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "comm").read_text().strip() in names:
                return True
        except FileNotFoundError:
            continue
    return False


def parts(roles: dict[str, list[int]]) -> dict[str, float]:
    if "gateway" in roles:  # --workers 0
        gateway = roles["gateway"][0]
        front = thread_cpu(gateway, FRONT_THREADS)
        return {"front": front, "gateway": process_cpu(gateway) - front}
    router, worker = roles["router"][0], roles["workers"][0]
    front = thread_cpu(router, FRONT_THREADS)
    return {"front": front, "router": process_cpu(router) - front, "worker": process_cpu(worker)}


def minus(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {part: after[part] - before[part] for part in after}


async def one_round(url: str, prompt: str) -> dict[str, Any]:
    latencies: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        sids = await asyncio.gather(
            *(
                session_turns(client, TURNS, prompt, latencies, delete=False)
                for _ in range(SESSIONS)
            )
        )
    return {"sids": sids, "turns": len(latencies)}


def get_all(url: str, sids: list[str]) -> tuple[int, float]:
    """Each session's records, one GET after the other; the bytes and the seconds."""
    size = 0
    started = time.perf_counter()
    with httpx.Client(base_url=url, timeout=600) as client:
        for sid in sids:
            with client.stream("GET", f"/sessions/{sid}") as reply:
                reply.raise_for_status()
                for chunk in reply.iter_raw(MIB):
                    size += len(chunk)
    return size, time.perf_counter() - started


def delete_all(url: str, sids: list[str]) -> None:
    with httpx.Client(base_url=url, timeout=600) as client:
        for sid in sids:
            client.delete(f"/sessions/{sid}")


def memcpy_ms_per_mib(size: int) -> float:
    source = bytearray(os.urandom(MIB)) * max(1, size // MIB)
    target = bytearray(len(source))
    target[:] = source  # warm both
    started = time.process_time()
    for _ in range(5):
        target[:] = source
    return (time.process_time() - started) * 1000 / (5 * len(source) / MIB)


def socket_hop_ms_per_mib(size: int) -> float:
    """CPU of sending `size` bytes over loopback TCP and receiving them, both ends."""
    listener = socket.create_server(("127.0.0.1", 0))
    sender = socket.create_connection(listener.getsockname())
    receiver, _ = listener.accept()
    listener.close()
    payload = memoryview(bytearray(os.urandom(MIB)))
    chunks = max(1, size // MIB)

    def receive() -> None:
        buffer = bytearray(MIB)
        view = memoryview(buffer)
        left = chunks * MIB
        while left:
            left -= receiver.recv_into(view, min(MIB, left))

    with sender, receiver:
        for _ in range(2):  # the first pass warms the socket buffers
            reader = threading.Thread(target=receive)
            started = time.process_time()
            reader.start()
            for _ in range(chunks):
                sender.sendall(payload)
            reader.join()
            elapsed = time.process_time() - started
    return elapsed * 1000 / chunks


def roles_of(gw: ServerProcess, workers: int) -> dict[str, list[int]]:
    if workers:
        return process_roles(gw)
    assert gw.proc is not None
    return {"gateway": [gw.proc.pid]}


# Each configuration: its environment and its extra `serve` arguments.
CONFIGS: dict[str, tuple[dict[str, str], list[str]]] = {
    "rust": ({}, []),
    "python": ({"SESSIONGATE_IMPL": "python"}, []),
}
# --cold-start: the Rust core with nothing touched at start (and nothing kept warm).
UNTOUCHED = ({}, ["--warm-records-bytes", "0"])
# --files: the Rust core with records GETs through shared-memory files, as before lending.
FILES = ({}, ["--no-lent-replies"])
# Seconds after a gateway answers before its first round: the memory touched at start is
# touched in a thread by then (about 0.5 s per GiB).
SETTLE_S = 3.0


def run(
    rounds: int, workers: int = 1, cold_start: bool = False, files: bool = False
) -> dict[str, Any]:
    configs = dict(CONFIGS)
    if cold_start:
        configs["rust_untouched"] = UNTOUCHED
    if files and workers:
        configs["rust_files"] = FILES
    prompt = " ".join(["word"] * 2000)
    per_round: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    cold: dict[str, float] = {}
    get_sizes: list[int] = []
    with ExitStack() as stack:
        gateways: dict[str, ServerProcess] = {}
        for name, (env, extra) in configs.items():
            port = free_port()
            argv = ["serve", "--port", str(port), "--workers", str(workers), "--r3"]
            argv += ["--mock-args", MOCK, *extra]
            gateways[name] = stack.enter_context(ServerProcess(argv, port, timeout=60, env=env))
        roles = {name: roles_of(gw, workers) for name, gw in gateways.items()}
        time.sleep(SETTLE_S)
        # What starting cost each gateway (every part), the records memory touched included.
        started = {name: sum(parts(roles[name]).values()) * 1000 for name in configs}
        order = list(configs)
        for index in range(rounds + 1):  # round 0 warms every gateway and is not counted
            for name in order if index % 2 == 0 else order[::-1]:
                url = gateways[name].url
                before = parts(roles[name])
                load = asyncio.run(one_round(url, prompt))
                turned = parts(roles[name])
                size, get_s = get_all(url, load["sids"])
                fetched = parts(roles[name])
                delete_all(url, load["sids"])
                if index == 0:  # a fresh gateway's first sessions: memory not yet touched
                    cold[name] = sum(minus(turned, before).values()) * 1000 / load["turns"]
                    continue
                get_sizes.append(size)
                turn_cpu = minus(turned, before)
                get_cpu = minus(fetched, turned)
                per_round[name].append(
                    {
                        "turn_ms": {p: v * 1000 / load["turns"] for p, v in turn_cpu.items()},
                        "get_ms_per_mib": {p: v * 1000 / (size / MIB) for p, v in get_cpu.items()},
                        "get_mib": size / MIB,
                        "get_s": get_s,
                        "turns": load["turns"],
                        "front_threads": has_threads(
                            next(iter(roles[name].values()))[0], ("sg-front",)
                        ),
                    }
                )
    size = int(statistics.median(get_sizes))
    floor = {"memcpy_ms_per_mib": memcpy_ms_per_mib(size), "socket_hop_ms_per_mib": 0.0}
    floor["socket_hop_ms_per_mib"] = socket_hop_ms_per_mib(size)
    results: dict[str, Any] = {"floor": {k: round(v, 3) for k, v in floor.items()}}
    turn_mib = size / MIB / (SESSIONS * TURNS)
    results["turn_mib"] = round(turn_mib, 1)
    results["turn_floor_ms"] = round(turn_mib * floor["socket_hop_ms_per_mib"], 2)
    for name, runs in per_round.items():
        turn = {p: statistics.median(r["turn_ms"][p] for r in runs) for p in runs[0]["turn_ms"]}
        get = {
            p: statistics.median(r["get_ms_per_mib"][p] for r in runs)
            for p in runs[0]["get_ms_per_mib"]
        }
        results[name] = {
            "turn_cpu_ms": {p: round(v, 2) for p, v in turn.items()},
            "turn_cpu_ms_total": round(sum(turn.values()), 2),
            "get_cpu_ms_per_mib": {p: round(v, 3) for p, v in get.items()},
            "get_mib_per_round": round(statistics.median(r["get_mib"] for r in runs), 1),
            "get_mib_per_s": round(statistics.median(r["get_mib"] / r["get_s"] for r in runs), 1),
            "compiled_front": all(r["front_threads"] for r in runs),
            "cold_turn_cpu_ms_total": round(cold[name], 2),
            "start_cpu_ms_total": round(started[name], 1),
        }
    rust, python = results["rust"], results["python"]
    results["python_over_rust_turn_cpu"] = round(
        python["turn_cpu_ms_total"] / rust["turn_cpu_ms_total"], 2
    )
    # The whole rollout: its turns and the GET of their records, every part.
    rollout = {
        name: results[name]["turn_cpu_ms_total"] * SESSIONS * TURNS
        + sum(results[name]["get_cpu_ms_per_mib"].values()) * results[name]["get_mib_per_round"]
        for name in ("rust", "python")
    }
    results["python_over_rust_rollout_cpu"] = round(rollout["python"] / rollout["rust"], 2)
    results["rust_turn_cpu_over_floor"] = round(
        rust["turn_cpu_ms_total"] / max(results["turn_floor_ms"], 0.01), 1
    )
    relay = rust["get_cpu_ms_per_mib"].get("router", 0.0) + rust["get_cpu_ms_per_mib"]["front"]
    results["rust_relay_over_socket_hop"] = round(
        relay / max(floor["socket_hop_ms_per_mib"], 0.001), 1
    )
    return results


def emit(results: dict[str, Any], path: Path | None) -> None:
    """A scenario's results: printed as JSON, and written to `path` when given."""
    text = json.dumps(results, indent=2)
    print(text)
    if path is not None:
        path.write_text(text + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one counted round")
    parser.add_argument("--rounds", type=int, default=5, help="counted rounds (5)")
    parser.add_argument("--workers", type=int, default=1, choices=(0, 1), help="layout (1)")
    parser.add_argument(
        "--cold-start",
        action="store_true",
        help="also run the Rust core with --warm-records-bytes 0 (nothing touched at start)",
    )
    parser.add_argument(
        "--files",
        action="store_true",
        help="also run the Rust core with --no-lent-replies (GETs through shared-memory files)",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    emit(run(rounds, args.workers, args.cold_start, args.files), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

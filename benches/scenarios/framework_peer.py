"""sessiongate side by side with the rollout framework's own session server, on R3 turns.

    FRAMEWORK_PYTHON=/path/fw-venv/bin/python FRAMEWORK_SRC=/path/miles \
        python benches/scenarios/framework_peer.py            # 3 counted rounds
    ... python benches/scenarios/framework_peer.py --quick    # 1 counted round

The peer is radixark/miles's v1 session server, unmodified: its `run_session_server` entry
point from a source checkout (FRAMEWORK_SRC), started by `miles_session_server.py` under an
interpreter of its own (FRAMEWORK_PYTHON). Without either, the bench prints why it skipped
and exits 0. docs/performance.md, "Side by side with the framework's session server", says
how to build that venv on a machine without a GPU.

One mock engine (`sessiongate mock-engine`, R3 64 layers x top-32, 64 new tokens) serves
every arm; every arm uses the mock's own tokenizer (the built-in ChatML one) and the same
TITO family (`--tito-model`, default `qwen3`: its fixed template and its newline after
`<|im_end|>`; the framework's `default` family joins without that newline, sessiongate's
with it, see docs/tokenizer.md), so all of them send the engine the same token ids (checked:
the last turn's `input_ids` of the first session must be equal across arms, or the bench
fails). Arms: `serve --workers 1 --r3`, `serve --workers 0 --r3` and the framework's server
(R3 on: `use_rollout_routing_replay`).
Each round runs every arm in turn, the order rotating: 4 concurrent sessions x 5 tool-loop
turns of a 2,000-word first prompt, then one GET of each session's records, one after the
other, then the deletes. A first round warms every arm and is not counted.

Figures per arm: turns/s of the turn phase, p50/p99 turn latency, CPU per turn (utime +
stime of the arm's whole process tree from /proc, the engine excluded), the records GET's
wall time and MiB, CPU per MiB of GET, and peak memory (the sum of VmHWM over the arm's
processes at the end). Ratios are sessiongate over the framework, in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_parts import delete_all, emit, get_all, process_cpu
from e2e_dataplane import session_turns

from sessiongate.tokenizer.chat_tokenizer import BUILTIN_TOKENIZER_DIR
from support.procs import ServerProcess, free_port, mock_engine

MOCK = ("--r3-layers", "64", "--r3-topk", "32", "--completion-tokens", "64")
SESSIONS, TURNS = 4, 5
MIB = 1 << 20
FRAMEWORK = "framework"
HERE = Path(__file__).resolve().parent


def tree_pids(root: int) -> list[int]:
    """`root` and every process below it (from /proc's children lists)."""
    pids, queue = [], [root]
    while queue:
        pid = queue.pop()
        pids.append(pid)
        try:
            for task in Path(f"/proc/{pid}/task").iterdir():
                queue.extend(int(c) for c in (task / "children").read_text().split())
        except FileNotFoundError:  # gone meanwhile
            continue
    return pids


def tree_cpu(root: int) -> float:
    total = 0.0
    for pid in tree_pids(root):
        try:
            total += process_cpu(pid)
        except FileNotFoundError:
            continue
    return total


def tree_peak_mib(root: int) -> float:
    """The sum of each process's peak resident set (VmHWM)."""
    total_kib = 0
    for pid in tree_pids(root):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                total_kib += int(line.split()[1])
    return total_kib / 1024


async def turn_phase(url: str, prompt: str) -> tuple[list[str], list[float], float]:
    latencies: list[float] = []
    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        sids = await asyncio.gather(
            *(
                session_turns(client, TURNS, prompt, latencies, delete=False)
                for _ in range(SESSIONS)
            )
        )
    return list(sids), latencies, time.perf_counter() - started


def last_prompt_ids(url: str, sid: str) -> list[int]:
    records = httpx.get(f"{url}/sessions/{sid}", timeout=600).json()["records"]
    ids: list[int] = records[-1]["request"]["input_ids"]
    return ids


def framework_launch(
    python: str, src: str, backend: str, port: int, tito_model: str = "default"
) -> ServerProcess:
    argv = ["--src", src, "--tokenizer", str(BUILTIN_TOKENIZER_DIR), "--port", str(port)]
    argv += ["--backend", backend, "--tito-model", tito_model]
    pythonpath = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    return ServerProcess(
        argv,
        port,
        timeout=180,  # the framework imports torch, transformers and sglang
        python=python,
        module="miles_session_server",
        env={"PYTHONPATH": pythonpath},
    )


def run(rounds: int, framework_python: str, framework_src: str, tito_model: str) -> dict[str, Any]:
    prompt = " ".join(["word"] * 2000)
    samples: dict[str, list[dict[str, Any]]] = {}
    with ExitStack() as stack:
        engine = stack.enter_context(mock_engine(*MOCK))
        arms: dict[str, ServerProcess] = {}
        for name, workers in (("sessiongate --workers 1", "1"), ("sessiongate --workers 0", "0")):
            port = free_port()
            argv = ["serve", "--port", str(port), "--workers", workers, "--r3", "--r3-topk", "32"]
            argv += ["--backend", engine.url, "--tito-model", tito_model]
            arms[name] = stack.enter_context(ServerProcess(argv, port, timeout=60))
        arms[FRAMEWORK] = stack.enter_context(
            framework_launch(framework_python, framework_src, engine.url, free_port(), tito_model)
        )
        samples = {name: [] for name in arms}
        order = list(arms)
        for index in range(rounds + 1):  # round 0 warms every arm and is not counted
            shift = index % len(order)
            first_ids: dict[str, list[int]] = {}
            for name in order[shift:] + order[:shift]:
                url = arms[name].url
                proc = arms[name].proc
                assert proc is not None
                cpu_before = tree_cpu(proc.pid)
                sids, latencies, turn_s = asyncio.run(turn_phase(url, prompt))
                cpu_turned = tree_cpu(proc.pid)
                size, get_s = get_all(url, sids)
                cpu_fetched = tree_cpu(proc.pid)
                if index == 0:
                    first_ids[name] = last_prompt_ids(url, sids[0])
                delete_all(url, sids)
                if index == 0:
                    continue
                samples[name].append(
                    {
                        "turns_per_s": len(latencies) / turn_s,
                        "latencies": latencies,
                        "turn_cpu_ms": (cpu_turned - cpu_before) * 1000 / len(latencies),
                        "get_mib": size / MIB,
                        "get_s": get_s,
                        "get_cpu_ms_per_mib": (cpu_fetched - cpu_turned) * 1000 / (size / MIB),
                    }
                )
            if index == 0 and len({tuple(ids) for ids in first_ids.values()}) != 1:
                raise RuntimeError(
                    "the arms sent the engine different token ids for the same conversation: "
                    + ", ".join(f"{name}: {len(ids)} ids" for name, ids in first_ids.items())
                )
        peaks = {name: tree_peak_mib(arm.proc.pid) for name, arm in arms.items() if arm.proc}
    return summarize(samples, peaks)


def summarize(samples: dict[str, list[dict[str, Any]]], peaks: dict[str, float]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, runs in samples.items():
        latencies = sorted(x for r in runs for x in r["latencies"])
        results[name] = {
            "turns_per_s": round(statistics.median(r["turns_per_s"] for r in runs), 2),
            "p50_ms": round(latencies[len(latencies) // 2] * 1000, 1),
            "p99_ms": round(
                latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1000, 1
            ),
            "turn_cpu_ms": round(statistics.median(r["turn_cpu_ms"] for r in runs), 1),
            # Each round's: the framework's moves by a third from round to round.
            "turn_cpu_ms_rounds": [round(r["turn_cpu_ms"], 1) for r in runs],
            "get_mib": round(statistics.median(r["get_mib"] for r in runs), 1),
            "get_ms": round(statistics.median(r["get_s"] for r in runs) * 1000),
            "get_cpu_ms_per_mib": round(
                statistics.median(r["get_cpu_ms_per_mib"] for r in runs), 3
            ),
            "peak_mib": round(peaks[name]),
        }
    peer = results[FRAMEWORK]
    results["ratios_over_framework"] = {
        name: {
            key: round(figures[key] / peer[key], 3) if peer[key] else None
            for key in ("turns_per_s", "p50_ms", "p99_ms", "turn_cpu_ms", "get_ms", "peak_mib")
        }
        for name, figures in results.items()
        if name != FRAMEWORK and name in samples
    }
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one counted round")
    parser.add_argument("--rounds", type=int, default=3, help="counted rounds (3)")
    parser.add_argument(
        "--tito-model", default="qwen3", help="the TITO family every arm uses (qwen3)"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    framework_python = os.environ.get("FRAMEWORK_PYTHON", "")
    framework_src = os.environ.get("FRAMEWORK_SRC", "")
    if not framework_python or not os.access(framework_python, os.X_OK):
        print("skipped: FRAMEWORK_PYTHON (the framework's venv interpreter) is not given")
        return 0
    if not (Path(framework_src) / "miles" / "rollout" / "session" / "server.py").is_file():
        print("skipped: FRAMEWORK_SRC (a radixark/miles checkout) is not given")
        return 0
    rounds = 1 if args.quick else args.rounds
    emit(run(rounds, framework_python, framework_src, args.tito_model), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

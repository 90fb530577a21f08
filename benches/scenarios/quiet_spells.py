"""CPU per R3 turn when a batch comes after a quiet spell: freed records' memory kept warm
(`--warm-records-bytes`, default 1G) against all of it given back (`0`).

    python benches/scenarios/quiet_spells.py              # 3 counted rounds, 12 s pauses
    python benches/scenarios/quiet_spells.py --quick      # 1 counted round
    python benches/scenarios/quiet_spells.py --pause 0    # no quiet spell (both stay warm)

A rollout's batches come a training step apart; a worker gives freed memory back to the OS
after 10 quiet seconds (`process/memory.py`). Two `serve --workers 1 --r3` gateways, each
with its embedded mock engine (R3 64 layers x top-32, 64 new tokens: ~23 MiB of base64 R3
per turn, 2,000-word first prompts): the default and `--warm-records-bytes 0`. Each round
runs, on both gateways in alternating order, 4 concurrent sessions x 5 turns then the
deletes, then pauses `--pause` seconds, so each gateway's next round comes after more than
that long without a request. A first round fills each gateway's memory and is not counted.

Figures per configuration (medians over the counted rounds): worker and router CPU per R3
turn (utime + stime from /proc), the worker's minor page faults per turn, and the worker's
resident memory at the end of each pause (VmRSS). The ratio is `0` over the default.
docs/performance.md, "Warm memory across quiet spells", has the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_parts import MOCK, delete_all, emit, one_round, process_cpu
from e2e_dataplane import minor_faults, process_roles, rss_mib

from support.procs import ServerProcess, free_port

CONFIGS: dict[str, list[str]] = {"warm (default)": [], "given back (0)": ["0"]}
MIB = 1 << 20


def run(rounds: int, pause: float) -> dict[str, Any]:
    prompt = " ".join(["word"] * 2000)
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in CONFIGS}
    with ExitStack() as stack:
        gateways: dict[str, ServerProcess] = {}
        for name, warm in CONFIGS.items():
            port = free_port()
            argv = ["serve", "--port", str(port), "--workers", "1", "--r3", "--mock-args", MOCK]
            argv += ["--warm-records-bytes", *warm] if warm else []
            gateways[name] = stack.enter_context(ServerProcess(argv, port, timeout=60))
        roles = {name: process_roles(gw) for name, gw in gateways.items()}
        order = list(CONFIGS)
        for index in range(rounds + 1):  # round 0 fills each gateway's memory, not counted
            rss: dict[str, float] = {}
            for name in order if index % 2 == 0 else order[::-1]:
                worker, router = roles[name]["workers"][0], roles[name]["router"][0]
                before = (process_cpu(worker), process_cpu(router), minor_faults(worker))
                load = asyncio.run(one_round(gateways[name].url, prompt))
                after = (process_cpu(worker), process_cpu(router), minor_faults(worker))
                delete_all(gateways[name].url, load["sids"])
                if index:
                    turns = load["turns"]
                    samples[name].append(
                        {
                            "worker_ms": (after[0] - before[0]) * 1000 / turns,
                            "router_ms": (after[1] - before[1]) * 1000 / turns,
                            "faults": (after[2] - before[2]) / turns,
                        }
                    )
            time.sleep(pause)
            for name in order:  # after the quiet spell: what each worker kept
                rss[name] = rss_mib(roles[name]["workers"][0])
            if index:
                for name in order:
                    samples[name][-1]["rss_mib"] = rss[name]
    results: dict[str, Any] = {"pause_s": pause, "rounds": rounds}
    for name, runs in samples.items():
        results[name] = {key: round(statistics.median(r[key] for r in runs), 2) for key in runs[0]}
    warm, cold = (results[name] for name in CONFIGS)
    results["given_back_over_warm_worker_cpu"] = round(
        cold["worker_ms"] / max(warm["worker_ms"], 0.01), 2
    )
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one counted round")
    parser.add_argument("--rounds", type=int, default=3, help="counted rounds (3)")
    parser.add_argument(
        "--pause", type=float, default=12.0, help="seconds between rounds (12: past the trim)"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    emit(run(1 if args.quick else args.rounds, args.pause), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

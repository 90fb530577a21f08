"""End-to-end scenarios of the real-engine contracts, each comparing configurations in one run.

    python benches/scenarios/e2e_contracts.py                 # all scenarios
    python benches/scenarios/e2e_contracts.py --quick         # small sizes (a smoke run)
    python benches/scenarios/e2e_contracts.py --only r3addition

Scenarios (figures go to docs/performance.md):
  r3addition  one 50-turn tool-loop session with R3 (48 layers x top-8, the shape of a large
              MoE) through two in-process gateways on one mock engine, full R3 vs
              --r3-addition, sessions interleaved turn by turn: upstream reply bytes per turn
              (first, last, total), gateway CPU per turn, and whether the two trajectory
              files are byte-identical.
  ttft        time to first token of a streamed session turn, --stream-upstream buffered vs
              relay against a default engine (served buffered: its stream drops logprobs)
              vs relay against an engine with a tool-call parser (the mock engine at 20 ms to
              first token and 5 ms per token, one token per stream step, 64-token
              completions ended by the stop token), alternating turns: p50 TTFT, p50 total
              time and the in-process gateway's CPU per turn (/proc); every turn recorded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from support.procs import ServerProcess, free_port


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def mock_engine(*args: str) -> Iterator[ServerProcess]:
    port = free_port()
    with ServerProcess(["mock-engine", "--port", str(port), *args], port, timeout=60) as proc:
        yield proc


@contextmanager
def inprocess_gateway(engine: ServerProcess, *args: str) -> Iterator[ServerProcess]:
    """`serve --workers 0`: one process, so its CPU is the gateway's whole CPU."""
    port = free_port()
    argv = ["serve", "--port", str(port), "--workers", "0", "--backend", engine.url, *args]
    with ServerProcess(argv, port, timeout=60) as proc:
        yield proc


def tensor_digest(safetensors_file: bytes) -> str:
    """A digest of a safetensors file's tensors (names, dtypes, shapes, data), not of its
    `__metadata__` (timestamps and cache figures differ between two runs of a session)."""
    size = int.from_bytes(safetensors_file[:8], "little")
    header = json.loads(safetensors_file[8 : 8 + size])
    header.pop("__metadata__", None)
    digest = hashlib.sha256(json.dumps(header, sort_keys=True).encode())
    digest.update(safetensors_file[8 + size :])
    return digest.hexdigest()


def scenario_r3addition(quick: bool) -> dict[str, Any]:
    turns = 10 if quick else 50
    mock = ("--r3-layers", "48", "--r3-topk", "8", "--completion-tokens", "24")
    mock += ("--completion-tokens-jitter", "0")
    with ExitStack() as stack:
        engine = stack.enter_context(mock_engine(*mock))
        full = stack.enter_context(inprocess_gateway(engine, "--r3", "--r3-topk", "8"))
        addition = stack.enter_context(
            inprocess_gateway(engine, "--r3", "--r3-topk", "8", "--r3-addition")
        )
        configs = {"full": full, "addition": addition}
        clients = {name: httpx.Client(base_url=gw.url, timeout=120) for name, gw in configs.items()}
        stack.callback(lambda: [c.close() for c in clients.values()])
        sids = {name: c.post("/sessions").json()["session_id"] for name, c in clients.items()}
        messages: dict[str, list[dict[str, Any]]] = {
            name: [{"role": "user", "content": "Plan a route through the valley."}]
            for name in configs
        }
        cpu = dict.fromkeys(configs, 0.0)
        wall = dict.fromkeys(configs, 0.0)
        for turn in range(turns):
            for name, client in clients.items():
                pid = configs[name].proc.pid  # type: ignore[union-attr]
                before_cpu, before = cpu_seconds(pid), time.perf_counter()
                reply = client.post(
                    f"/sessions/{sids[name]}/v1/chat/completions",
                    json={"messages": messages[name], "max_tokens": 24, "seed": turn},
                )
                wall[name] += time.perf_counter() - before
                cpu[name] += cpu_seconds(pid) - before_cpu
                reply.raise_for_status()
                messages[name].append(reply.json()["choices"][0]["message"])
                messages[name].append({"role": "tool", "content": f"observation {turn}: ok"})
        figures: dict[str, Any] = {"turns": turns}
        digests = {}
        for name, client in clients.items():
            records = client.get(f"/sessions/{sids[name]}").json()["records"]
            sizes = [len(json.dumps(r["response"], separators=(",", ":"))) for r in records]
            trajectory = client.get(f"/sessions/{sids[name]}/trajectory").content
            digests[name] = tensor_digest(trajectory)
            figures[name] = {
                "reply_bytes_first_turn": sizes[0],
                "reply_bytes_last_turn": sizes[-1],
                "reply_bytes_total_mib": round(sum(sizes) / 2**20, 2),
                "cpu_ms_per_turn": round(1000 * cpu[name] / turns, 2),
                "wall_ms_per_turn": round(1000 * wall[name] / turns, 2),
            }
        figures["trajectories_identical"] = digests["full"] == digests["addition"]
        figures["bytes_ratio_full_over_addition"] = round(
            figures["full"]["reply_bytes_total_mib"]
            / max(figures["addition"]["reply_bytes_total_mib"], 1e-9),
            1,
        )
        figures["cpu_ratio_full_over_addition"] = round(
            figures["full"]["cpu_ms_per_turn"] / max(figures["addition"]["cpu_ms_per_turn"], 1e-9),
            2,
        )
        return figures


def _streamed_turn(client: httpx.Client, sid: str, prompt: str) -> tuple[float, float]:
    """(time to the first content delta, total time) of one streamed turn, in ms."""
    started = time.perf_counter()
    first: float | None = None
    body = {"messages": [{"role": "user", "content": prompt}], "stream": True, "max_tokens": 64}
    with client.stream("POST", f"/sessions/{sid}/v1/chat/completions", json=body) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if first is None and line.startswith("data: {") and '"content":"' in line:
                if '"content":""' not in line:
                    first = time.perf_counter()
    total = time.perf_counter() - started
    return 1000 * ((first or time.perf_counter()) - started), 1000 * total


def scenario_ttft(quick: bool) -> dict[str, Any]:
    rounds = 5 if quick else 30
    mock = ("--ttft-ms", "20", "--token-delay-ms", "5", "--completion-tokens", "64")
    mock += ("--completion-tokens-jitter", "0", "--stream-chunk-tokens", "1")
    with ExitStack() as stack:
        # A default engine (no parser: its stream drops the logprobs of steps without text,
        # so `relay` serves it buffered) and one with a tool-call parser (really relayed).
        plain = stack.enter_context(mock_engine(*mock))
        parsed = stack.enter_context(mock_engine(*mock, "--tool-call-parser", "qwen25"))
        setups = {
            "buffered": (plain, "buffered"),
            "relay_default_engine": (plain, "relay"),
            "relay_parser_engine": (parsed, "relay"),
        }
        configs = {
            name: stack.enter_context(inprocess_gateway(engine, "--stream-upstream", mode))
            for name, (engine, mode) in setups.items()
        }
        clients = {name: httpx.Client(base_url=gw.url, timeout=60) for name, gw in configs.items()}
        stack.callback(lambda: [c.close() for c in clients.values()])
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
        cpu = dict.fromkeys(configs, 0.0)
        for round_index in range(rounds):
            for name, client in clients.items():
                pid = configs[name].proc.pid  # type: ignore[union-attr]
                sid = client.post("/sessions").json()["session_id"]
                before = cpu_seconds(pid)
                samples[name].append(_streamed_turn(client, sid, f"question {round_index}"))
                cpu[name] += cpu_seconds(pid) - before
                records = client.get(f"/sessions/{sid}").json()["records"]
                assert len(records) == 1, f"{name}: the streamed turn was not recorded"
                client.delete(f"/sessions/{sid}")
        return {
            name: {
                "ttft_ms_p50": round(statistics.median(t for t, _ in runs), 1),
                "total_ms_p50": round(statistics.median(total for _, total in runs), 1),
                "gateway_cpu_ms_per_turn": round(1000 * cpu[name] / rounds, 2),
            }
            for name, runs in samples.items()
        }


SCENARIOS = {"r3addition": scenario_r3addition, "ttft": scenario_ttft}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=sorted(SCENARIOS), action="append")
    args = parser.parse_args()
    for name in args.only or list(SCENARIOS):
        started = time.perf_counter()
        figures = SCENARIOS[name](args.quick)
        figures["scenario_s"] = round(time.perf_counter() - started, 1)
        print(json.dumps({name: figures}, indent=2), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

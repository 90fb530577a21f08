"""sessiongate side by side with the SGLang Model Gateway (`sglang-router`), same mock engine,
same 1 KiB chat body, same external load generator (`wrk`), alternating rounds.

    python benches/scenarios/peer.py                 # 3 rounds x (c=1, c=64), 8 s each
    python benches/scenarios/peer.py --quick         # 1 round, 3 s each (a smoke run)
    SGLANG_ROUTER_PYTHON=/path/venv/bin/python python benches/scenarios/peer.py

Targets: the engine itself (the baseline; a canned-reply server by default, the mock engine
with `--engine mock`), `sglang-router --policy manual` (Rust, in
its own venv: not a dependency; skipped with a message when absent), and sessiongate
`serve --workers 0` and `--workers 2`, all forwarding stateless `POST /v1/chat/completions`
to the same engine. Per target and concurrency: req/s, p50/p99 from wrk's latency
distribution, added p50 (the target's p50 minus the engine's in the same round) and CPU
per request of the target's own processes (/proc/PID/stat; the engine excluded). Session
turns (TITO) are not wrk-shaped (each needs the previous reply): `--sessions` adds, per
round, sequential session turns at c=1 on the project's lean client, each gateway's p50
minus the p50 of the same client sending the same conversation straight to the engine; the
canned engine answers a token-in request (`input_ids`) with an SGLang-shaped reply
(`meta_info` with the output ids and logprobs), so a turn is recorded exactly as with the
real engine. The summary gives their ratio to sglang-router's stateless added p50 (the
session-turn goal in docs/performance.md). Figures go to docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from support.procs import ServerProcess, free_port

PEER_VENVS = ("/work/sgl-venv", "/tmp/peer", os.path.expanduser("~/.venvs/sglang-router"))
SMG_VENVS = ("/work/smgvenv", os.path.expanduser("~/.venvs/smg"))
# ~1 KiB request body, a short reply: the routers' per-request cost dominates.
BODY = {
    "model": "default",
    "messages": [
        {"role": "system", "content": "You are a helpful assistant. " * 8},
        {"role": "user", "content": "Summarise the following notes. " + "lorem ipsum " * 50},
    ],
    "max_tokens": 8,
}
WRK_SCRIPT = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [[{body}]]
"""
_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0, "m": 60_000.0}


CANNED_REPLY = json.dumps(
    {
        "id": "canned",
        "object": "chat.completion",
        "created": 0,
        "model": "default",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 200, "completion_tokens": 2, "total_tokens": 202},
    }
).encode()


def _tito_reply() -> bytes:
    """What the mock engine (like SGLang) answers a token-in chat request with
    `return_meta_info`: the OpenAI reply plus the sampled ids and their logprobs."""
    tokens = [(-0.25, 6671, "who"), (-0.05, 828, " result"), (-0.5, 466, " as")]
    text = "".join(token for _, _, token in tokens)
    document = json.loads(CANNED_REPLY)
    choice = document["choices"][0]
    choice["message"]["content"] = text
    choice["finish_reason"] = "length"
    choice["meta_info"] = {
        "id": "canned",
        "finish_reason": {"type": "length", "length": len(tokens)},
        "prompt_tokens": 4,
        "weight_version": "default",
        "output_token_logprobs": [list(t) for t in tokens],
        "completion_tokens": len(tokens),
        "cached_tokens": 0,
    }
    return json.dumps(document).encode()


TITO_REPLY = _tito_reply()
# The canned engine: an asyncio protocol answering every request with one fixed chat reply
# (GET /health too; the TITO one to a body with `input_ids`), so the routers, not the
# engine, are what saturates.
CANNED_ENGINE = r"""
import asyncio, sys
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
REPLY, TITO = (arg.encode() for arg in sys.argv[2:4])
RESPONSE, TITO_RESPONSE = (HEAD % len(r) + r for r in (REPLY, TITO))
class Engine(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport, self.buffer = transport, b""
    def data_received(self, data):
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end].lower() + b"\r\n"
            at = head.find(b"content-length:")
            length = int(head[at + 15 : head.find(b"\r\n", at)]) if at >= 0 else 0
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4 : end + 4 + length]
            self.buffer = self.buffer[end + 4 + length:]
            self.transport.write(TITO_RESPONSE if b'"input_ids"' in body else RESPONSE)
async def main():
    server = await asyncio.get_running_loop().create_server(Engine, "127.0.0.1", int(sys.argv[1]))
    await server.serve_forever()
asyncio.run(main())
"""


def peer_python() -> str | None:
    """The interpreter of a venv with sglang-router installed, or None."""
    candidates = [os.environ.get("SGLANG_ROUTER_PYTHON", "")]
    candidates += [f"{venv}/bin/python" for venv in PEER_VENVS]
    for python in candidates:
        if not python or not Path(python).exists():
            continue
        probe = subprocess.run(
            [python, "-c", "import sglang_router"], capture_output=True, check=False
        )
        if probe.returncode == 0:
            return python
    return None


def smg_bin() -> str | None:
    """The `smg` launcher of a venv with smg (the Shepherd Model Gateway, sglang-router's
    successor; 1.13 measured) installed, or None: `$SMG_BIN`, else `$SMG_PYTHON`'s sibling
    `smg`, else the known venvs, else `smg` on PATH; each must answer `--help` as smg."""
    candidates = [os.environ.get("SMG_BIN", "")]
    if os.environ.get("SMG_PYTHON"):
        candidates.append(str(Path(os.environ["SMG_PYTHON"]).with_name("smg")))
    candidates += [f"{venv}/bin/smg" for venv in SMG_VENVS]
    candidates.append(shutil.which("smg") or "")
    for binary in candidates:
        if not binary or not Path(binary).exists():
            continue
        probe = subprocess.run([binary, "--help"], capture_output=True, text=True, check=False)
        if probe.returncode == 0 and "Shepherd Model Gateway" in probe.stdout:
            return binary
    return None


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it."""
    found = [pid]
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        found += descendants(int(child))
    return found


@contextmanager
def started(cmd: list[str], port: int, ready: str = "/health") -> Iterator[subprocess.Popen[bytes]]:
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"{cmd[:4]} exited: {log.read().decode(errors='replace')}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}{ready}", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{cmd[:4]} not ready on port {port}")
            time.sleep(0.1)
        yield proc
    finally:
        with open(os.devnull, "wb"):
            try:
                os.killpg(proc.pid, 15)
            except ProcessLookupError:
                pass
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
        log.close()


def parse_wrk(text: str) -> dict[str, float]:
    """req/s and p50/p99 (ms) from `wrk --latency` output."""
    rate = re.search(r"Requests/sec:\s+([\d.]+)", text)
    total = re.search(r"(\d+) requests in", text)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    socket_errors = re.search(r"Socket errors: (.*)", text)
    result: dict[str, float] = {
        "rps": float(rate.group(1)) if rate else 0.0,
        "requests": float(total.group(1)) if total else 0.0,
        "non_2xx": float(errors.group(1)) if errors else 0.0,
        "socket_errors": float(sum(int(n) for n in re.findall(r"\d+", socket_errors.group(1))))
        if socket_errors
        else 0.0,
    }
    for q in ("50", "99"):
        match = re.search(rf"^\s+{q}\.000%\s+([\d.]+)(us|ms|s|m)\s*$", text, re.MULTILINE)
        if match is None:
            match = re.search(rf"^\s+{q}%\s+([\d.]+)(us|ms|s|m)\s*$", text, re.MULTILINE)
        result[f"p{q}_ms"] = float(match.group(1)) * _UNITS[match.group(2)] if match else 0.0
    return result


def wrk(url: str, connections: int, seconds: float, script: Path) -> dict[str, float]:
    threads = 1 if connections == 1 else 2
    out = subprocess.run(
        [
            "wrk",
            f"-t{threads}",
            f"-c{connections}",
            f"-d{seconds:g}s",
            "--latency",
            "-s",
            str(script),
            url + "/v1/chat/completions",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return parse_wrk(out.stdout)


def session_p50(url: str, turns: int, session: bool = True) -> float:
    """p50 (ms) of sequential turns of growing conversations on the lean client: session
    turns (X-Session-ID, TITO), or with `session` False the same requests without the header
    (the baseline, sent straight to the engine)."""
    import asyncio

    from sessiongate.http.client import HttpClient

    def new_headers() -> dict[str, str]:
        headers = {"content-type": "application/json"}
        if session:
            headers["x-session-id"] = f"peer-{time.time_ns()}"
        return headers

    async def run() -> float:
        client = HttpClient()
        latencies: list[float] = []
        headers = new_headers()
        messages: list[dict[str, Any]] = list(BODY["messages"])  # type: ignore[arg-type]
        for turn in range(turns):
            body = json.dumps({**BODY, "messages": messages}).encode()
            began = time.perf_counter()
            async with client.request(
                "POST", url + "/v1/chat/completions", headers=headers, body=body
            ) as reply:
                data = await reply.read()
            latencies.append(time.perf_counter() - began)
            if reply.status != 200:
                raise RuntimeError(f"session turn {turn}: {reply.status} {data[:200]!r}")
            messages.append(json.loads(data)["choices"][0]["message"])
            messages.append({"role": "tool", "content": f"result {turn}"})
            if len(messages) > 40:  # keep prompts ~constant: a new session
                headers = new_headers()
                messages = list(BODY["messages"])  # type: ignore[arg-type]
        await client.aclose()
        return 1000 * statistics.median(latencies[5:])

    return asyncio.run(run())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--sessions", action="store_true", help="also session turns at c=1")
    parser.add_argument(
        "--fronts",
        default="compiled,python",
        help="sessiongate front doors to compare, comma list of compiled (the Rust HTTP "
        "server, the default) and python (uvicorn alone, `--front python`)",
    )
    parser.add_argument(
        "--engine",
        choices=("canned", "mock"),
        default="canned",
        help="canned: a fixed reply from a minimal asyncio server, fast enough that the "
        "routers saturate first (default); mock: the built-in mock engine (~500 req/s here, "
        "so at c=64 it measures the engine)",
    )
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.seconds = 1, 3.0
    if shutil.which("wrk") is None:
        print("skipped: wrk is not installed (Debian: apt-get install wrk)")
        return 0
    peer = peer_python()
    if peer is None:
        print(
            "sglang-router not found (python3 -m venv /work/sgl-venv && /work/sgl-venv/bin/pip "
            "install sglang-router, or set SGLANG_ROUTER_PYTHON): comparing without it"
        )
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "post.lua"
        script.write_text(WRK_SCRIPT.format(body=json.dumps(BODY)))
        engine_port = free_port()
        if args.engine == "canned":
            cmd = [sys.executable, "-c", CANNED_ENGINE, str(engine_port)]
            cmd += [CANNED_REPLY.decode(), TITO_REPLY.decode()]
            stack.enter_context(started(cmd, engine_port))
            engine_url = f"http://127.0.0.1:{engine_port}"
        else:
            engine_url = stack.enter_context(
                ServerProcess(["mock-engine", "--port", str(engine_port)], engine_port)
            ).url
        targets: dict[str, tuple[str, list[int]]] = {"engine": (engine_url, [])}
        if peer is not None:
            port = free_port()
            cmd = [peer, "-m", "sglang_router.launch_router", "--port", str(port)]
            cmd += ["--policy", "manual", "--worker-urls", engine_url, "--log-level", "warn"]
            proc = stack.enter_context(started(cmd, port))
            targets["sglang-router"] = (f"http://127.0.0.1:{port}", descendants(proc.pid))
        fronts = [f.strip() for f in args.fronts.split(",") if f.strip()]
        for front in fronts:
            for workers in (0, 2):
                port = free_port()
                serve = ["serve", "--port", str(port), "--workers", str(workers)]
                serve += ["--front", front, "--backend", engine_url]
                gw = stack.enter_context(ServerProcess(serve, port, timeout=60))
                assert gw.proc is not None
                name = f"sg-w{workers}" + ("" if front == "compiled" else "-py")
                targets[name] = (gw.url, descendants(gw.proc.pid))
        rows: dict[tuple[str, int], list[dict[str, float]]] = {}
        sessions: dict[str, list[float]] = {}
        for round_index in range(args.rounds):
            for connections in (1, 64):
                base_p50 = 0.0
                for name, (url, pids) in targets.items():
                    before = cpu_seconds(pids)
                    figures = wrk(url, connections, args.seconds, script)
                    used = cpu_seconds(pids) - before
                    if name == "engine":
                        base_p50 = figures["p50_ms"]
                    figures["added_p50_ms"] = figures["p50_ms"] - base_p50
                    figures["cpu_us_per_request"] = (
                        1e6 * used / figures["requests"] if pids and figures["requests"] else 0.0
                    )
                    rows.setdefault((name, connections), []).append(figures)
                    print(
                        f"round {round_index + 1} c={connections:<2} {name:<15} "
                        f"{figures['rps']:>8.0f} req/s  p50 {figures['p50_ms']:.3f} ms  "
                        f"p99 {figures['p99_ms']:.3f} ms  +{figures['added_p50_ms']:.3f} ms  "
                        f"cpu {figures['cpu_us_per_request']:.0f} us/req",
                        flush=True,
                    )
            if args.sessions:
                turns = 60 if args.quick else 300
                direct = session_p50(engine_url, turns, session=False)
                for name, (url, _) in targets.items():
                    if name.startswith("sg-"):
                        added = session_p50(url, turns) - direct
                        sessions.setdefault(name, []).append(added)
                        print(
                            f"round {round_index + 1} session turns {name:<9} +{added:.3f} ms "
                            f"(engine direct {direct:.3f} ms)",
                            flush=True,
                        )
    summary = {
        f"{name} c={c}": {
            key: round(statistics.median(r[key] for r in runs), 3)
            for key in ("rps", "p50_ms", "p99_ms", "added_p50_ms", "cpu_us_per_request")
        }
        | {"errors": sum(r["non_2xx"] + r["socket_errors"] for r in runs)}
        for (name, c), runs in rows.items()
    }
    if sessions:
        added = {name: statistics.median(runs) for name, runs in sessions.items()}
        summary["session_turn_added_p50_ms_c1"] = {k: round(v, 3) for k, v in added.items()}
        if ("sglang-router", 1) in rows:
            peer_added = summary["sglang-router c=1"]["added_p50_ms"]
            summary["session_turn_vs_sglang_stateless_c1"] = {
                k: round(v / peer_added, 2) for k, v in added.items() if peer_added > 0
            }
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`sessiongate bench` end to end: real processes on loopback (mock engine, gateway, driver).

The driver runs as its own process (`python -m sessiongate.loadgen.cli bench`, the same
parser and `run` that `sessiongate bench` registers). Shapes are checked against the
workload the same seed generates, through the raw export's `trace_id`s.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import pytest

from sessiongate.loadgen.trace import read_trace_file
from sessiongate.loadgen.workload import SessionSpec, SyntheticOptions, SyntheticWorkload
from support.procs import ServerProcess, free_port

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

BENCH = [sys.executable, "-m", "sessiongate.loadgen.cli", "bench"]

# One synthetic workload with a bit of everything: variable turns, children at two levels,
# fan-out, parents that wait and parents that do not.
TREE_OPTIONS: dict[str, Any] = {
    "seed": 11,
    "turns": 3,
    "turns_stddev": 1,
    "child_prob": 0.5,
    "fanout": 2,
    "depth": 2,
    "child_turns": 2,
    "max_tokens": 8,
    "prompt_tokens": 8,
    "system_tokens": 4,
    "append_tokens": 4,
}
TREE_SESSIONS = 6


def _flags(options: dict[str, Any]) -> list[str]:
    return [a for k, v in options.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def _expected(sessions: int, options: dict[str, Any]) -> list[SessionSpec]:
    workload = SyntheticWorkload(SyntheticOptions(**options))
    return [workload.root(i) for i in range(sessions)]


def bench(
    *args: str, check: bool = True, timeout: float = 60.0
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [*BENCH, "--progress", "plain", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    if check and done.returncode != 0:
        raise AssertionError(f"bench exited {done.returncode}\n{done.stdout}\n{done.stderr}")
    return done


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_shape(raw: list[dict[str, Any]], roots: list[SessionSpec], *, session_api: bool) -> None:
    """The raw export has exactly these sessions, turns and tree shape, in a legal order."""
    expected = {node.id: (node, parent, t) for root in roots for node, parent, t in root.walk()}
    by_trace: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in raw:
        assert record["error_key"] is None, record
        by_trace[record["trace_id"]].append(record)
    assert set(by_trace) == set(expected)
    sid = {}
    for trace_id, records in by_trace.items():
        ids = {r["session_id"] for r in records}
        assert len(ids) == 1, (trace_id, ids)
        sid[trace_id] = ids.pop()
    assert len(set(sid.values())) == len(sid)

    def end(r: dict[str, Any]) -> float:
        return r["start_s"] + r["latency_s"]

    for trace_id, records in by_trace.items():
        node, parent, parent_turn = expected[trace_id]
        records.sort(key=lambda r: r["start_s"])
        chats = [r for r in records if r["kind"] == "chat"]
        assert [r["turn"] for r in chats] == list(range(len(node.turns)))
        assert [r["final"] for r in chats] == [t == len(node.turns) - 1 for t in range(len(chats))]
        root_trace = trace_id.split(".")[0]
        for r in records:
            assert r["root_id"] == sid[root_trace]
            assert r["parent_id"] == (None if parent is None else sid[parent.id])
        kinds = [r["kind"] for r in records]
        if session_api:
            assert kinds == ["create", *["chat"] * len(chats), "records", "delete"]
            assert records[-2]["bytes_received"] > 0
        else:
            assert kinds == ["chat"] * len(chats)
        if parent is not None:
            parent_chats = sorted(
                (r for r in by_trace[parent.id] if r["kind"] == "chat"), key=lambda r: r["turn"]
            )
            # Spawned after the parent's turn replied ...
            assert records[0]["start_s"] >= end(parent_chats[parent_turn])
            # ... and, when the parent waits, done before the parent's next turn.
            if parent.turns[parent_turn].wait_children and parent_turn + 1 < len(parent_chats):
                assert parent_chats[parent_turn + 1]["start_s"] >= end(chats[-1])
            if session_api:  # a parent is closed only after its children
                parent_delete = next(r for r in by_trace[parent.id] if r["kind"] == "delete")
                assert parent_delete["start_s"] >= end(records[-1])


@pytest.fixture(scope="module")
def engine() -> Any:
    port = free_port()
    with ServerProcess(["mock-engine", "--port", str(port)], port) as proc:
        yield proc


@pytest.fixture(scope="module")
def gateway() -> Any:
    port = free_port()
    with ServerProcess(["serve", "--port", str(port), "--workers", "2"], port) as proc:
        yield proc


def test_openai_target_sends_the_asked_tree_shape(engine, tmp_path):
    raw = tmp_path / "raw.jsonl"
    summary = tmp_path / "summary.json"
    bench("--url", engine.url, "--target", "openai", "--sessions", str(TREE_SESSIONS),
          "--concurrency", "3", "--stream", *_flags(TREE_OPTIONS),
          "--raw", str(raw), "--json", str(summary))  # fmt: skip
    records = read_jsonl(raw)
    check_shape(records, _expected(TREE_SESSIONS, TREE_OPTIONS), session_api=False)
    s = json.loads(summary.read_text())
    assert s["turns"]["ok"] == len(records)
    assert s["ttft_ms"]["count"] == len(records)  # streamed: every turn has a TTFT
    assert all(r["ttft_s"] is not None and r["completion_tokens"] for r in records)
    assert s["errors"]["total"] == 0


def test_sessiongate_target_sends_the_asked_tree_shape(gateway, tmp_path):
    raw = tmp_path / "raw.jsonl"
    summary = tmp_path / "summary.json"
    bench("--url", gateway.url, "--sessions", str(TREE_SESSIONS), "--concurrency", "3",
          "--tools", *_flags(TREE_OPTIONS), "--raw", str(raw), "--json", str(summary))  # fmt: skip
    records = read_jsonl(raw)
    roots = _expected(TREE_SESSIONS, TREE_OPTIONS)
    check_shape(records, roots, session_api=True)
    s = json.loads(summary.read_text())
    sessions = sum(root.count()[0] for root in roots)
    assert s["records_get"]["latency_ms"]["count"] == sessions
    assert s["records_get"]["bytes_total"] == sum(
        r["bytes_received"] for r in records if r["kind"] == "records"
    )
    assert s["sessions"] == {
        "started": sessions,
        "completed": sessions,
        "failed": 0,
        "trees_completed": TREE_SESSIONS,
    }
    # Every session was deleted: the gateway holds none of them any more.
    assert httpx.get(gateway.url + f"/sessions/{records[0]['session_id']}").status_code == 410


def test_trace_write_and_replay_give_the_same_shape(gateway, tmp_path):
    trace = tmp_path / "trace.jsonl"
    options = {**TREE_OPTIONS, "seed": 12, "think_time": 0.01}
    written = bench("--sessions", "4", *_flags(options), "--write-trace", str(trace))
    assert "wrote 4 root sessions" in written.stdout
    header, roots = read_trace_file(trace)
    generated = _expected(4, options)
    assert header.generator["synthetic"]["seed"] == 12
    assert [r.count() for r in roots] == [r.count() for r in generated]
    for a, b in zip(roots, generated, strict=True):
        assert [n.turns[0].messages for n, _, _ in a.walk()] == [
            n.turns[0].messages for n, _, _ in b.walk()
        ]
    raw = tmp_path / "raw.jsonl"
    bench("--url", gateway.url, "--trace", str(trace), "--raw", str(raw), "--concurrency", "2")
    check_shape(read_jsonl(raw), roots, session_api=True)


ROUTING_CASES = {
    "dynamo_headers": ([], lambda s, p, r: {"X-Dynamo-Session-ID": s}
                       | ({"X-Dynamo-Parent-Session-ID": p} if p else {})),
    "smg_routing_key": ([], lambda s, p, r: {"X-SMG-Routing-Key": s}),
    "session_id_header": (["header_name=X-Correlation-ID"],
                          lambda s, p, r: {"X-Correlation-ID": s}),
    "identity_headers": (["session=X-Session-ID,X-SMG-Routing-Key", "parent=X-Parent",
                          "root=X-Root"],
                         lambda s, p, r: {"X-Session-ID": s, "X-SMG-Routing-Key": s,
                                          "X-Root": r} | ({"X-Parent": p} if p else {})),
    "dynamo_nvext": (["timeout_seconds=77"], lambda s, p, r: {}),
}  # fmt: skip


@pytest.mark.parametrize("mode", sorted(ROUTING_CASES))
def test_every_routing_mode_is_stamped(engine, tmp_path, mode):
    opts, expected_headers = ROUTING_CASES[mode]
    raw = tmp_path / "raw.jsonl"
    bench("--url", engine.url, "--target", "openai", "--session-routing", mode,
          *[a for o in opts for a in ("--session-routing-opt", o)],
          "--sessions", "2", "--turns", "3", "--child-prob", "1", "--max-spawns", "1",
          "--child-turns", "2", "--raw", str(raw))  # fmt: skip
    records = read_jsonl(raw)
    assert len(records) == 2 * 3 + 2 * 2
    assert any(r["parent_id"] for r in records)
    for r in records:
        assert r["headers"] == expected_headers(r["session_id"], r["parent_id"], r["root_id"])
    if mode != "dynamo_nvext":
        return
    # The mode rewrote the bodies: what the engine received binds and closes sessions.
    received = httpx.get(engine.url + f"/mock/requests?last={len(records)}").json()["requests"]
    controls = {}
    for body in received:
        control = body["nvext"]["session_control"]
        controls.setdefault(control["session_id"], []).append(control)
    assert set(controls) == {r["session_id"] for r in records}
    for sid, seq in controls.items():
        assert [c["action"] for c in seq] == ["bind"] * (len(seq) - 1) + ["close"], sid
        assert all(c["timeout"] == 77 for c in seq[:-1])
    for r in records:
        action = "close" if r["final"] else "bind"
        assert r["body_stamp"]["nvext"]["session_control"]["action"] == action


def test_failing_upstream_shows_in_error_counts(tmp_path):
    port = free_port()
    summary = tmp_path / "summary.json"
    raw = tmp_path / "raw.jsonl"
    with ServerProcess(["mock-engine", "--port", str(port), "--fail-rate", "0.5"], port) as eng:
        args = ["--url", eng.url, "--target", "openai", "--sessions", "10", "--turns", "3",
                "--child-prob", "0.5", "--session-routing", "dynamo_headers"]  # fmt: skip
        done = bench(*args, "--json", str(summary), "--raw", str(raw))
        assert "errors" in done.stdout
        s = json.loads(summary.read_text())
        assert s["errors"]["by_status"]["500"] > 0
        assert s["errors"]["total"] == s["errors"]["by_status"]["500"]
        assert s["sessions"]["failed"] > 0
        assert s["turns"]["ok"] > 0
        assert s["sessions"]["trees_completed"] == 10  # the run went to the end
        failed = [r for r in read_jsonl(raw) if r["error_key"]]
        assert all(r["status"] == 500 and "injected failure" in r["error"] for r in failed)
        assert bench(*args, "--fail-on-errors", check=False).returncode == 1


def test_unreachable_target_is_an_error_count_not_a_crash(tmp_path):
    summary = tmp_path / "summary.json"
    url = f"http://127.0.0.1:{free_port()}"
    bench("--url", url, "--model", "m", "--sessions", "3", "--json", str(summary))
    s = json.loads(summary.read_text())
    assert s["errors"]["by_status"] == {"connect": 3}
    assert s["sessions"]["failed"] == 3


def test_ctrl_c_prints_the_partial_summary(engine, tmp_path):
    summary = tmp_path / "summary.json"
    proc = subprocess.Popen(
        [*BENCH, "--url", engine.url, "--target", "openai", "--sessions", "1000",
         "--concurrency", "4", "--think-time", "0.2", "--progress", "plain",
         "--progress-interval", "0.2", "--json", str(summary)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        # Progress lines until one shows finished turns: the run is under way.
        while True:
            line = proc.stderr.readline()
            assert line.startswith("bench"), line
            if int(re.search(r"(\d+) turns", line).group(1)):  # type: ignore[union-attr]
                break
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "interrupted" in out
    s = json.loads(summary.read_text())
    assert s["interrupted"] is True
    assert s["turns"]["ok"] > 0
    assert s["sessions"]["started"] < 1000


def test_plot_is_written(engine, tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "bench.png"
    bench("--url", engine.url, "--target", "openai", "--sessions", "4", "--plot", str(plot))
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_exits_zero():
    done = subprocess.run(
        [sys.executable, "-m", "sessiongate", "demo", "--progress", "plain"],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "sessions verified token-exact: 80/80" in done.stdout
    assert "turns/s" in done.stdout

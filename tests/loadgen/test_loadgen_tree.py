"""`sessiongate bench` tree sessions: the generator, the driver's expectations, the tree check,
and the driver against a real `serve --session-mode tree` on the mock engine.

The end-to-end runs check the report against what the driver did, read back from its own
raw export: every successful chat is a node, every branch end and every abandoned retry
a leaf, and the gateway's samples are the leaves its default picker keeps.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from sessiongate.loadgen.cli import main as bench_main
from sessiongate.loadgen.http import Exchange, _chat_reply, _SseState
from sessiongate.loadgen.tree_check import SamplesPayload, TreeTally, check_tree
from sessiongate.loadgen.tree_log import LoggedNode, TreeLog
from sessiongate.loadgen.tree_workload import TreeOptions, TreeWorkload
from sessiongate.loadgen.workload import SyntheticOptions, SyntheticWorkload
from support.procs import ServerProcess, free_port

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

BENCH = [sys.executable, "-m", "sessiongate.loadgen.cli", "bench", "--progress", "off"]


# --- generator -------------------------------------------------------------------------


def _trees(n: int, seed: int = 3, **tree: Any) -> list[Any]:
    workload = TreeWorkload(
        SyntheticOptions(seed=seed, turns=4, turns_stddev=1), TreeOptions(**tree)
    )
    return [workload.root(i) for i in range(n)]


def test_tree_sessions_are_reproducible_and_keep_the_synthetic_main_line():
    opts = {"retry_rate": 0.3, "fork_rate": 0.3, "resume_rate": 0.5}
    a, b = _trees(20, **opts), _trees(40, **opts)[:20]
    assert a == b  # root i does not depend on the run's length
    line = SyntheticWorkload(SyntheticOptions(seed=3, turns=4, turns_stddev=1))
    for i, session in enumerate(a):
        # The same conversations as a linear run of the seed: tree vs linear comparisons.
        assert session.main.turns == line.root(i).turns
        assert session.id == f"s{i}"
    assert (
        any(s.forks for s in a) and any(s.resume for s in a) and any(any(s.main.retries) for s in a)
    )


def test_tree_rates_place_branches_where_they_may_go():
    nothing = _trees(10)
    assert all(not s.forks and s.resume is None and not any(s.main.retries) for s in nothing)
    everything = _trees(10, retry_rate=1, fork_rate=1, resume_rate=1, fork_turns=3, resume_turns=1)
    for s in everything:
        n = len(s.main.turns)
        # A fork after every main-line turn but the last (after the last it would be a
        # continuation, not a second live branch) ...
        assert [f.after for f in s.forks] == list(range(n - 1))
        assert all(len(f.turns) == 3 and f.retries == [1, 1, 1] for f in s.forks)
        assert s.main.retries == [1] * n
        # ... and a resume from a turn before the last, when there is one.
        if n == 1:
            assert s.resume is None
        else:
            assert s.resume is not None and 0 <= s.resume.after < n - 1
            assert len(s.resume.turns) == 1
        assert s.main.depth(0) == 0 and s.forks[0].depth(0) == 1 if s.forks else True


@pytest.mark.parametrize(
    ("tree", "synthetic", "message"),
    [
        ({"retry_rate": 1.5}, {}, "--tree-retry-rate"),
        ({"fork_turns": 0}, {}, "--tree-fork-turns"),
        ({}, {"child_prob": 0.5}, "no sub-agents"),
    ],
)
def test_tree_options_are_checked(tree, synthetic, message):
    with pytest.raises(ValueError, match=message):
        TreeWorkload(SyntheticOptions(**synthetic), TreeOptions(**tree))


def test_cli_refuses_tree_options_it_cannot_honour(capsys, tmp_path):
    url = ["--url", "http://127.0.0.1:9", "--model", "m"]
    assert bench_main(["bench", *url, "--tree", "--target", "openai"]) == 2
    assert "--target sessiongate" in capsys.readouterr().err
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"id": "s0", "turns": [{"messages": [{"role": "user", "content": "x"}]}]}\n')
    assert bench_main(["bench", *url, "--tree-fork-rate", "0.5", "--trace", str(trace)]) == 2
    assert "tree sessions are synthetic" in capsys.readouterr().err
    assert bench_main(["bench", "--tree", "--write-trace", str(tmp_path / "w.jsonl")]) == 2
    assert "--write-trace writes linear sessions" in capsys.readouterr().err


# --- reply identity ----------------------------------------------------------------------


def test_chat_replies_keep_their_id_and_finish_reason():
    ex = Exchange(kind="chat", started=0.0)
    body = {"id": "r1", "choices": [{"message": {"content": "hi"}, "finish_reason": "length"}]}
    _chat_reply(json.dumps(body).encode(), ex)
    assert (ex.response_id, ex.finish_reason, ex.ok) == ("r1", "length", True)
    stream = Exchange(kind="chat", started=0.0)
    state = _SseState()
    state.feed(json.dumps({"id": "r2", "choices": [{"delta": {"content": "a"}}]}), stream)
    state.feed(
        json.dumps({"id": "r2", "choices": [{"delta": {}, "finish_reason": "stop"}]}), stream
    )
    assert (stream.response_id, stream.finish_reason) == ("r2", "stop")


# --- expectations and the check ------------------------------------------------------------


def _log(*edges: tuple[int | None, bool]) -> TreeLog:
    """Nodes in reply order: (parent key, abandoned)."""
    log = TreeLog()
    for parent, abandoned in edges:
        log.add(parent=parent, branch="main", depth=0, response_id=f"r{len(log.nodes)}",
                finish_reason="stop", messages=[], reply={}, abandoned=abandoned)  # fmt: skip
    return log


def _by_key(node: LoggedNode) -> float:
    return float(node.key)


def test_picked_leaves_follow_the_gateways_default_picker():
    # 0 -> {1 (abandoned), 2}; 2 -> {3, 4 (a fork, committed later)}; 4 -> 5; 0 -> 6 (resume).
    # A retry of the first turn (7, a second root) has no siblings and stays a sample.
    log = _log((None, False), (0, True), (0, False), (2, False), (2, False), (4, False),
               (0, False), (None, True), (None, False))  # fmt: skip
    assert [n.key for n in log.leaves()] == [1, 3, 5, 6, 7, 8]
    # 1 has later siblings (2, 6); 3 has a later sibling (4, whose branch went on).
    assert [n.key for n in log.picked("drop_retries", _by_key)] == [5, 6, 7, 8]
    assert [n.key for n in log.picked("keep_all", _by_key)] == [1, 3, 5, 6, 7, 8]
    # The commit order decides between concurrent siblings: 4 before 3 keeps 3.
    swapped = {3: 4.5}
    order = lambda n: swapped.get(n.key, float(n.key))  # noqa: E731
    assert [n.key for n in log.picked("drop_retries", order)] == [3, 5, 6, 7, 8]


def _payload(
    log: TreeLog, picked: list[int], *, parents: dict[int, int | None] | None = None
) -> SamplesPayload:
    parents = parents or {}
    table = [
        {"id": n.key, "parent": parents.get(n.key, n.parent), "seq": n.key,
         "response_id": n.response_id}
        for n in log.nodes
    ]  # fmt: skip
    samples = [{"metadata": {"leaf": {"node_id": k}}} for k in picked]
    return SamplesPayload(samples, {"tree": {"nodes": table}}, {})


def test_check_tree_matches_the_gateways_tree_through_reply_ids():
    log = _log((None, False), (0, True), (0, False), (2, False))
    log.retries = 1
    ok = check_tree(log, _payload(log, [3]), "drop_retries")
    assert ok.problems == []
    assert (ok.nodes, ok.leaves, ok.samples, ok.expected_samples, ok.retries) == (4, 2, 1, 1, 1)
    assert ok.matched
    # The gateway kept the abandoned retry too: wrong for drop_retries, right for keep_all.
    both = _payload(log, [1, 3])
    assert check_tree(log, both, "drop_retries").problems == [
        "samples: 2, expected 1 (drop_retries keeps 1 of 2 leaves)"
    ]
    assert check_tree(log, both, "keep_all").problems == []
    assert check_tree(log, both, "off").problems == []
    # Same counts, wrong leaf picked.
    assert check_tree(log, _payload(log, [1]), "drop_retries").problems == [
        "samples are leaves [1], expected leaves [3]"
    ]
    # A turn attached somewhere else than where the driver continued.
    moved = check_tree(log, _payload(log, [3], parents={3: 1}), "drop_retries").problems
    assert moved == [
        "reply r3 (main, depth 0): the gateway attached it under node 1, "
        "the driver continued node 2"
    ]
    # A reply the gateway does not hold.
    short = _payload(log, [3])
    short.session_metadata["tree"]["nodes"].pop(1)
    problems = check_tree(log, short, "drop_retries").problems
    assert problems[0] == "nodes: 3, the driver got 4 replies"
    assert "reply r1 (main, depth 0) is not a node of the gateway's tree" in problems
    # Without reply ids only the counts are compared (and the samples by count).
    for node in log.nodes:
        node.response_id = None
    blind = check_tree(log, _payload(log, [1]), "drop_retries")
    assert (blind.matched, blind.problems) == (False, [])


def test_tally_sums_sessions_and_keeps_a_few_problems():
    log = _log((None, False), (0, False))
    tally = TreeTally()
    tally.add("a", check_tree(log, _payload(log, [1]), "drop_retries"))
    for i in range(30):
        tally.add(f"b{i}", check_tree(log, _payload(log, []), "drop_retries"))
    j = tally.to_json()
    assert (j["sessions"], j["fetched"], j["nodes"], j["samples"]) == (31, 31, 62, 1)
    assert j["expected"] == {"nodes": 62, "leaves": 31, "samples": 31}
    assert j["mismatched_sessions"] == 30 and len(j["problems"]) == 20


# --- against a real gateway in --session-mode tree --------------------------------------

# The mock's replies vary in length around 12 tokens, so with --max-tokens 12 some are cut
# at the limit: those branches end there (the gateway refuses to extend them) and count as
# `cut`, not as errors.
MOCK = "--completion-tokens 12 --completion-tokens-jitter 3"
TREE_FLAGS = ["--turns", "4", "--turns-stddev", "1", "--max-tokens", "14", "--seed", "5",
              "--system-tokens", "4", "--prompt-tokens", "8", "--append-tokens", "4",
              "--tree-retry-rate", "0.25", "--tree-fork-rate", "0.3", "--tree-resume-rate", "0.5",
              "--tree-fork-turns", "2", "--tree-resume-turns", "2"]  # fmt: skip


@pytest.fixture(scope="module")
def tree_gateway() -> Any:
    port = free_port()
    args = ["serve", "--port", str(port), "--workers", "2", "--session-mode", "tree",
            "--mock-args", MOCK]  # fmt: skip
    with ServerProcess(args, port) as proc:
        yield proc


def bench(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [*BENCH, *args], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )
    if check and done.returncode != 0:
        raise AssertionError(f"bench exited {done.returncode}\n{done.stdout}\n{done.stderr}")
    return done


def _run(
    tree_gateway: Any, tmp_path: Path, *flags: str
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    summary, raw = tmp_path / "summary.json", tmp_path / "raw.jsonl"
    bench("--url", tree_gateway.url, *flags, "--json", str(summary), "--raw", str(raw))
    records = [json.loads(line) for line in raw.read_text().splitlines()]
    return json.loads(summary.read_text()), records


def _from_raw(records: list[dict[str, Any]]) -> dict[str, int]:
    """What the driver did, read from its raw export alone."""
    chats = [r for r in records if r["kind"] == "chat"]
    sends = Counter((r["session_id"], r["trace_id"], r["turn"]) for r in chats)
    branches = {(r["session_id"], r["trace_id"]) for r in chats}
    return {
        "nodes": len(chats),
        "retries": sum(n - 1 for n in sends.values()),
        "forks": sum(1 for _, trace in branches if "/fork" in trace),
        "resumes": sum(1 for _, trace in branches if trace.endswith("/resume")),
        # One leaf per branch end, plus every abandoned attempt.
        "leaves": len(branches) + sum(n - 1 for n in sends.values()),
    }


def test_tree_workload_report_matches_what_the_driver_did(tree_gateway, tmp_path):
    s, records = _run(tree_gateway, tmp_path, "--sessions", "12", "--concurrency", "4",
                      "--tools", *TREE_FLAGS)  # fmt: skip
    assert s["errors"]["total"] == 0, s["tree"]["problems"]
    assert all(r["error_key"] is None for r in records)
    tree = s["tree"]
    did = _from_raw(records)
    assert tree["nodes"] == tree["expected"]["nodes"] == did["nodes"] == s["turns"]["ok"]
    assert tree["leaves"] == tree["expected"]["leaves"] == did["leaves"]
    assert (tree["retries"], tree["forks"], tree["resumes"]) == (
        did["retries"], did["forks"], did["resumes"])  # fmt: skip
    assert did["retries"] and did["forks"] and did["resumes"]  # the seed exercises all three
    # The default picker keeps every leaf but the abandoned attempts (and any leaf a later
    # fork or resume superseded); the driver's expectation matched leaf for leaf.
    assert 0 < tree["samples"] == tree["expected"]["samples"] <= tree["leaves"]
    assert tree["cut"] > 0  # some replies hit max_tokens, and nothing failed because of it
    assert (tree["sessions"], tree["fetched"], tree["mismatched_sessions"]) == (12, 12, 0)
    assert tree["matched_by_reply_id"] == 12  # the shape was checked, not just the counts
    assert s["requests"]["samples"] == s["requests"]["records"] == s["requests"]["delete"] == 12
    by_session = Counter(r["session_id"] for r in records if r["kind"] == "create")
    assert len(by_session) == 12


def test_tree_workload_streams_and_skips_records(tree_gateway, tmp_path):
    s, records = _run(tree_gateway, tmp_path, "--sessions", "4", "--stream", "--no-records",
                      *TREE_FLAGS)  # fmt: skip
    assert s["errors"]["total"] == 0, s["tree"]["problems"]
    assert s["requests"]["records"] == 0 and s["requests"]["samples"] == 4
    assert s["tree"]["nodes"] == _from_raw(records)["nodes"]
    assert s["tree"]["samples"] == s["tree"]["expected"]["samples"]
    assert s["tree"]["matched_by_reply_id"] == 4  # streamed replies carry the node's id too


def test_a_wrong_expectation_is_an_error_in_the_report_not_a_crash(tree_gateway, tmp_path):
    # keep_all expects every abandoned retry as a sample; the gateway drops them.
    flags = [
        "--sessions",
        "4",
        *TREE_FLAGS,
        "--tree-retry-rate",
        "1",
        "--tree-expect-pick",
        "keep_all",
    ]
    s, records = _run(tree_gateway, tmp_path, *flags)
    tree = s["tree"]
    assert tree["mismatched_sessions"] == 4
    assert s["errors"]["by_status"] == {"tree_mismatch": 4}
    assert s["errors"]["by_request"] == {"samples": 4}
    assert s["sessions"]["failed"] == 4
    assert tree["samples"] < tree["expected"]["samples"] == tree["leaves"]
    assert all("keep_all keeps" in p for p in tree["problems"])
    failed = [r for r in records if r["error_key"]]
    assert [r["kind"] for r in failed] == ["samples"] * 4
    done = bench("--url", tree_gateway.url, *flags, "--fail-on-errors", check=False)
    assert done.returncode == 1
    assert "MISMATCH" in done.stdout

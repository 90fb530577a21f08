"""`sessiongate demo`'s tree part: the tree sessions it drives and the per-leaf verification.

The full demo (linear part included) runs in test_loadgen_e2e.py; here a small linear part
keeps the run short, and the verifier is shown to catch what it claims to catch by
feeding it sessions from a real tree gateway with one thing changed at a time.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import subprocess
import sys
from typing import Any

import pytest

from sessiongate.demo.trees import SHAPES, tree_sessions
from sessiongate.demo.verify_trees import TreeVerifier
from sessiongate.loadgen.pacing import Pacing
from sessiongate.loadgen.runner import BenchConfig, run_bench
from sessiongate.loadgen.tree_driver import TreeSession
from sessiongate.loadgen.workload import DEFAULT_TOOLS
from support.procs import ServerProcess, free_port

# Starts processes on loopback: `pytest -m "not procs"` skips it (docs/development.md).
pytestmark = pytest.mark.procs

DEMO = [sys.executable, "-m", "sessiongate", "demo", "--progress", "off"]


def demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*DEMO, *args], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
    )


def test_demo_verifies_every_leaf_of_its_tree_sessions():
    done = demo("--sessions", "4", "--turns", "3", "--child-turns", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "sessions verified token-exact: 8/8" in out  # the linear part, as before
    assert "tree sessions: 4 (1 retry, 1 fork, 1 resume, 1 all)" in out
    assert "tree nodes / leaves / samples" in out
    assert "tree sessions verified: 4/4 (10 leaves, 8 samples)" in out
    assert "leaf samples verified token-exact: 8/8" in out
    assert "active paths verified token-exact: 4/4" in out
    assert "abandoned retries dropped by the picker: 2/2" in out
    assert sum(s.samples for s in SHAPES) == 8 and sum(s.leaves for s in SHAPES) == 10


@pytest.fixture(scope="module")
def tree_gateway() -> Any:
    port = free_port()
    args = ["serve", "--port", str(port), "--workers", "0", "--session-mode", "tree"]
    with ServerProcess(args, port) as proc:
        yield proc


def test_demo_skips_trees_on_a_given_gateway_and_with_zero_trees(tree_gateway):
    # A linear workload on a tree gateway is one path per session: the linear check holds.
    done = demo("--url", tree_gateway.url, "--sessions", "2", "--turns", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "sessions verified token-exact: 4/4" in done.stdout
    assert "tree sessions: skipped (--url" in done.stdout
    none = demo("--url", tree_gateway.url, "--sessions", "1", "--turns", "1", "--trees", "0")
    assert none.returncode == 0 and "tree sessions" not in none.stdout


@pytest.fixture(scope="module")
def sessions(tree_gateway) -> list[TreeSession]:
    """The demo's four tree sessions as the verifier receives them."""
    seen: list[TreeSession] = []
    config = BenchConfig(
        url=tree_gateway.url,
        pacing=Pacing(sessions=4, concurrency=4),
        tools=DEFAULT_TOOLS,
        progress="off",
        tree=True,
    )
    outcome = asyncio.run(run_bench(config, tree_sessions(4, 0), tree_hook=seen.append))
    assert outcome.summary["errors"]["total"] == 0
    return sorted(seen, key=lambda s: s.spec.id)


def _verify(session: TreeSession) -> list[str]:
    verifier = TreeVerifier(DEFAULT_TOOLS)
    verifier(session)
    return verifier.problems


def test_untouched_sessions_verify(sessions):
    verifier = TreeVerifier(DEFAULT_TOOLS)
    for session in sessions:
        verifier(session)
    assert verifier.problems == []
    assert (verifier.exact_sessions, verifier.exact_samples, verifier.active_paths) == (4, 8, 4)
    assert (verifier.abandoned, verifier.abandoned_dropped) == (2, 2)


def _all(sessions: list[TreeSession]) -> TreeSession:
    """A copy of the session with all three shapes, to change (the samples stay shared)."""
    session = next(s for s in sessions if s.spec.id.endswith("-all"))
    return dataclasses.replace(
        session, log=copy.deepcopy(session.log), records=copy.deepcopy(session.records)
    )


def test_a_completion_that_is_not_the_sampled_ids_is_caught(sessions):
    session = _all(sessions)
    node = session.log.nodes[0]  # on every leaf's path
    assert node.completion_ids
    node.completion_ids[0] += 1
    problems = _verify(session)
    assert sum("completion is not the engine's sampled ids" in p for p in problems) == 3


def test_a_conversation_that_renders_differently_is_caught(sessions):
    session = _all(sessions)
    leaf = next(n for n in session.log.leaves() if n.branch == "fork0")
    leaf.messages[-1] = {**leaf.messages[-1], "content": leaf.messages[-1]["content"] + " x"}
    problems = _verify(session)
    assert len(problems) == 1 and "a fresh render of the leaf's conversation differs" in problems[0]


def test_a_picked_abandoned_retry_and_a_wrong_active_path_are_caught(sessions):
    session = _all(sessions)
    kept = next(n for n in session.log.leaves() if n.branch == "main" and not n.abandoned)
    kept.abandoned = True
    assert any("an abandoned retry was picked" in p for p in _verify(session))
    session = _all(sessions)
    assert session.records is not None
    session.records["metadata"]["accumulated_token_ids"].append(1)
    problems = _verify(session)
    assert any(p.endswith("active path: the active path's ids are not its sample's tokens")
               for p in problems)  # fmt: skip

"""Compare the tree the gateway holds for a session with what the driver did.

Inputs: the driver's `TreeLog`, and the `/samples` payload (its `session_metadata.tree` is
the node table; its samples are the picked leaves). Nodes are matched through the reply
`id` (`response_id` in the node table), so the check covers the shape, not just counts:
every reply the driver kept or abandoned is a node, under the node it continued. A
mismatch is a list of problems the driver turns into an error of the session's samples
request; it never raises.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sessiongate.formats.safetensors import SafetensorsError, Tensor, decode, typed
from sessiongate.loadgen.tree_log import LoggedNode, TreeLog

SHOWN_PROBLEMS = 20  # problems kept in the summary (all of them count)


@dataclass(slots=True)
class SamplesPayload:
    """A decoded `/samples` reply: per-sample metadata, the session's, and the tensors."""

    samples: list[dict[str, Any]]
    session_metadata: dict[str, Any]
    tensors: dict[str, Tensor]

    def tokens(self, index: int) -> list[int]:
        return list(typed(self.tensors[f"tokens.{index}"]))

    def leaf(self, index: int) -> dict[str, Any]:
        leaf: dict[str, Any] = self.samples[index]["metadata"]["leaf"]
        return leaf

    def tree_nodes(self) -> list[dict[str, Any]]:
        nodes: list[dict[str, Any]] = self.session_metadata["tree"]["nodes"]
        return nodes


def parse_samples(body: bytes) -> SamplesPayload:
    """ValueError (with the reason) when `body` is not a tree session's samples payload."""
    try:
        tensors, _ = decode(body)
        meta = json.loads(bytes(tensors["_samples_meta"].data))
        samples = meta["samples"]
        session_metadata = meta["session_metadata"]
        # Checked here so that the comparison can index without guarding every step.
        valid = isinstance(session_metadata["tree"]["nodes"], list) and all(
            isinstance(sample["metadata"]["leaf"]["node_id"], int) for sample in samples
        )
    except (SafetensorsError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a tree samples payload: {type(exc).__name__}: {exc}") from exc
    if not valid:
        raise ValueError("not a tree samples payload: no node table or leaf descriptors")
    return SamplesPayload(samples, session_metadata, tensors)


@dataclass(slots=True)
class TreeResult:
    """One session: the gateway's counts, the driver's expectations, and what differs."""

    nodes: int = 0
    leaves: int = 0
    samples: int = 0
    expected_nodes: int = 0
    expected_leaves: int = 0
    expected_samples: int | None = None  # None: --tree-expect-pick off
    retries: int = 0
    forks: int = 0
    resumes: int = 0
    cut: int = 0
    fetched: bool = False  # the samples payload came back and parsed
    matched: bool = False  # nodes matched through reply ids: the shape was checked too
    problems: list[str] = field(default_factory=list)


def _match(log: TreeLog, table: Sequence[dict[str, Any]]) -> dict[int, dict[str, Any]] | None:
    """Driver key -> the gateway's node, through the reply ids; None when the ids cannot
    identify nodes (missing or repeated)."""
    ids = [n.response_id for n in log.nodes]
    if not all(ids) or len(set(ids)) != len(ids):
        return None
    by_id: dict[str, dict[str, Any]] = {}
    for node in table:
        rid = node.get("response_id")
        if not rid or rid in by_id:
            return None
        by_id[rid] = node
    return {n.key: by_id[n.response_id] for n in log.nodes if n.response_id in by_id}


def _where(node: LoggedNode) -> str:
    return f"reply {node.response_id} ({node.branch}, depth {node.depth})"


def _structure(log: TreeLog, matched: dict[int, dict[str, Any]], problems: list[str]) -> None:
    for node in log.nodes:
        server = matched.get(node.key)
        if server is None:
            problems.append(f"{_where(node)} is not a node of the gateway's tree")
            continue
        want = None if node.parent is None else matched.get(node.parent, {}).get("id")
        if server["parent"] != want:
            problems.append(
                f"{_where(node)}: the gateway attached it under node {server['parent']}, "
                f"the driver continued node {want}"
            )


def check_tree(log: TreeLog, payload: SamplesPayload, picker: str) -> TreeResult:
    """Counts and problems of one session (`picker`: the gateway's pick hook, or "off")."""
    table = payload.tree_nodes()
    result = TreeResult(
        nodes=len(table),
        samples=len(payload.samples),
        expected_nodes=len(log.nodes),
        expected_leaves=len(log.leaves()),
        retries=log.retries,
        forks=log.forks,
        resumes=log.resumes,
        cut=log.cut,
        fetched=True,
    )
    parents = {n["parent"] for n in table if n["parent"] is not None}
    result.leaves = sum(1 for n in table if n["id"] not in parents)
    problems = result.problems
    if result.nodes != result.expected_nodes:
        problems.append(f"nodes: {result.nodes}, the driver got {result.expected_nodes} replies")
    if result.leaves != result.expected_leaves:
        problems.append(f"leaves: {result.leaves}, expected {result.expected_leaves}")
    matched = _match(log, table)
    if matched is not None:
        result.matched = True
        _structure(log, matched, problems)
    if picker == "off":
        return result

    def order(node: LoggedNode) -> float:
        # Commit order: the gateway's seq when matched (concurrent forks commit in an order
        # only the gateway knows), else the order the replies arrived in.
        server = matched.get(node.key) if matched is not None else None
        return float(server["seq"]) if server is not None else float(node.key)

    expected = log.picked(picker, order)
    result.expected_samples = len(expected)
    if result.samples != result.expected_samples:
        problems.append(
            f"samples: {result.samples}, expected {result.expected_samples} ({picker} keeps "
            f"{len(expected)} of {result.expected_leaves} leaves)"
        )
    elif matched is not None:
        want = sorted(matched[n.key]["id"] for n in expected if n.key in matched)
        got = sorted(payload.leaf(i)["node_id"] for i in range(len(payload.samples)))
        if want != got:
            problems.append(f"samples are leaves {got}, expected leaves {want}")
    return result


@dataclass(slots=True)
class TreeTally:
    """The run's tree figures: sums over measured tree sessions (`summary["tree"]`)."""

    picker: str = "drop_retries"
    sessions: int = 0
    fetched: int = 0
    matched: int = 0
    nodes: int = 0
    leaves: int = 0
    samples: int = 0
    expected_nodes: int = 0
    expected_leaves: int = 0
    expected_samples: int = 0
    retries: int = 0
    forks: int = 0
    resumes: int = 0
    cut: int = 0
    mismatched: int = 0
    problems: list[str] = field(default_factory=list)

    def add(self, session_id: str, result: TreeResult) -> None:
        self.sessions += 1
        self.retries += result.retries
        self.forks += result.forks
        self.resumes += result.resumes
        self.cut += result.cut
        if not result.fetched:
            return
        self.fetched += 1
        self.matched += result.matched
        self.nodes += result.nodes
        self.leaves += result.leaves
        self.samples += result.samples
        self.expected_nodes += result.expected_nodes
        self.expected_leaves += result.expected_leaves
        self.expected_samples += result.expected_samples or 0
        if result.problems:
            self.mismatched += 1
            room = SHOWN_PROBLEMS - len(self.problems)
            self.problems += [f"{session_id}: {p}" for p in result.problems[: max(room, 0)]]

    def to_json(self) -> dict[str, Any]:
        return {
            "pick": self.picker,
            "sessions": self.sessions,
            "fetched": self.fetched,
            "matched_by_reply_id": self.matched,
            "nodes": self.nodes,
            "leaves": self.leaves,
            "samples": self.samples,
            "retries": self.retries,
            "forks": self.forks,
            "resumes": self.resumes,
            "cut": self.cut,
            "expected": {
                "nodes": self.expected_nodes,
                "leaves": self.expected_leaves,
                "samples": None if self.picker == "off" else self.expected_samples,
            },
            "mismatched_sessions": self.mismatched,
            "problems": list(self.problems),
        }

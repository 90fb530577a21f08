"""Checks that every leaf sample of a tree session is token-exact (the demo's tree hook).

Per session, from what the bench's tree driver hands over (its own log of every reply,
the records GET, the `/samples` payload):

- the driver's tree check found nothing (node count, each reply under the node it
  continued, leaves, the picked samples);
- the active path (GET /sessions/{id}) passes the linear demo's check (`verify.py`), and
  its accumulated ids are the tokens of the active leaf's sample;
- every sample, one per picked leaf: its tokens are the leaf's accumulated ids, the
  gateway's own re-render found no mismatch, a **fresh render on this side** of the leaf's
  conversation (the messages the driver sent along that path and the replies it kept)
  with the built-in tokenizer gives the same ids, and every completion on the path sits at
  its `completion_span`, id for id what the engine returned to the driver;
- no abandoned retry became a sample (the default picker drops them).
"""

from __future__ import annotations

from typing import Any

from sessiongate.demo.verify import trajectory_problems
from sessiongate.loadgen.tree_driver import TreeSession
from sessiongate.loadgen.tree_log import LoggedNode, TreeLog
from sessiongate.session.tito import TitoEngine
from sessiongate.tokenizer import load_tokenizer


def _leaf_problems(
    engine: TitoEngine,
    log: TreeLog,
    tokens: list[int],
    metadata: dict[str, Any],
    table: dict[int, dict[str, Any]],
    tools: list[dict[str, Any]] | None,
) -> list[str]:
    leaf = metadata["leaf"]
    problems = []
    if tokens != metadata["accumulated_token_ids"]:
        problems.append("tokens are not the leaf's accumulated ids")
    if metadata.get("tito_session_mismatch"):
        problems.append(f"gateway re-render mismatch: {metadata['tito_session_mismatch']}")
    by_reply = {n.response_id: n for n in log.nodes}
    node = by_reply.get(leaf["response_id"])
    if node is None:
        return [*problems, f"reply {leaf['response_id']!r} is not one the driver got"]
    path = log.path(node)
    server_path = [table[i] for i in leaf["path_node_ids"]]
    if [n.response_id for n in path] != [s["response_id"] for s in server_path]:
        problems.append("the leaf's path is not the driver's")
        return problems
    for mine, theirs in zip(path, server_path, strict=True):
        begin, end = theirs["completion_span"]
        if mine.completion_ids is None or tokens[begin:end] != mine.completion_ids:
            problems.append(f"node {theirs['id']}: completion is not the engine's sampled ids")
    rendered = engine.mismatches(log.path_messages(node), tools, tokens)
    if rendered:
        problems.append(f"a fresh render of the leaf's conversation differs: {rendered}")
    if node.abandoned and node.parent is not None:
        problems.append("an abandoned retry was picked")
    return problems


class TreeVerifier:
    """Tree hook for the bench: checks each closed tree session as it arrives."""

    def __init__(self, tools: list[dict[str, Any]] | None) -> None:
        self.tools = tools
        # The demo's gateway renders with the built-in tokenizer and template; so does this.
        self.engine = TitoEngine(load_tokenizer(None))
        self.sessions = 0
        self.exact_sessions = 0
        self.leaves = 0
        self.samples = 0
        self.exact_samples = 0
        self.active_paths = 0
        self.abandoned = 0
        self.abandoned_dropped = 0
        self.problems: list[str] = []

    def __call__(self, session: TreeSession) -> None:
        self.sessions += 1
        problems = [f"tree check: {p}" for p in session.result.problems]
        payload = session.samples
        try:
            if payload is None:
                problems.append("no samples payload")
            else:
                problems += self._samples(session, payload)
            problems += self._active_path(session)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            problems.append(f"unexpected payload: {type(exc).__name__}: {exc}")
        if problems:
            self.problems += [f"{session.handle.session_id}: {p}" for p in problems]
        else:
            self.exact_sessions += 1

    def _samples(self, session: TreeSession, payload: Any) -> list[str]:
        table = {n["id"]: n for n in payload.tree_nodes()}
        self.leaves += session.result.leaves
        picked: set[int] = set()
        problems = []
        for i, sample in enumerate(payload.samples):
            self.samples += 1
            metadata = sample["metadata"]
            node = self._node(session.log, metadata["leaf"]["response_id"])
            if node is not None:
                picked.add(node.key)
            found = _leaf_problems(
                self.engine, session.log, payload.tokens(i), metadata, table, self.tools
            )
            if found:
                leaf = metadata["leaf"]
                problems += [f"leaf {leaf['node_id']} {leaf['path_node_ids']}: {p}" for p in found]
            else:
                self.exact_samples += 1
        for node in session.log.nodes:
            if node.abandoned and node.parent is not None:
                self.abandoned += 1
                self.abandoned_dropped += node.key not in picked
        return problems

    def _active_path(self, session: TreeSession) -> list[str]:
        records = session.records
        if records is None:
            return ["no records GET body"]
        problems = trajectory_problems(records)
        active = records["metadata"]["tree"]["active"]
        payload = session.samples
        if payload is not None:
            leaves = [s["metadata"]["leaf"]["node_id"] for s in payload.samples]
            match = [i for i, node_id in enumerate(leaves) if node_id == active]
            if not match:
                problems.append(f"the active leaf {active} has no sample")
            elif payload.tokens(match[0]) != records["metadata"]["accumulated_token_ids"]:
                problems.append("the active path's ids are not its sample's tokens")
        if not problems:
            self.active_paths += 1
        return [f"active path: {p}" for p in problems]

    @staticmethod
    def _node(log: TreeLog, response_id: object) -> LoggedNode | None:
        return next((n for n in log.nodes if n.response_id == response_id), None)

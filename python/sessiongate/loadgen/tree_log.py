"""What the driver did in one tree session, and the tree the gateway should hold for it.

Every successful chat turn is one node (the gateway records a node per 200 reply and none
for a refused or failed turn). Its parent is the node whose reply ends the history the turn
extended (None for a first turn: a new root), which is exactly the gateway's attach point
for the histories this driver sends. From that alone the driver knows the node count, the
leaves, and which leaves the gateway's pick hook should keep.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

PICKERS = ("drop_retries", "keep_all", "off")


@dataclass(slots=True)
class LoggedNode:
    key: int  # the driver's index, in reply order
    parent: int | None
    branch: str
    depth: int
    response_id: str | None
    finish_reason: str | None
    messages: list[dict[str, Any]]  # the request's messages (the path up to this turn)
    reply: dict[str, Any]  # the assistant message appended after it
    abandoned: bool = False  # a retried attempt: the branch went on from a later sibling
    completion_ids: list[int] | None = None  # sampled ids, when the reply carries them


@dataclass(slots=True)
class TreeLog:
    nodes: list[LoggedNode] = field(default_factory=list)
    retries: int = 0  # re-sends of a turn
    forks: int = 0  # forked branches started
    resumes: int = 0  # resumed branches started
    cut: int = 0  # branches (or forks, resumes) not continued: a reply cut at max_tokens

    def add(self, **fields: Any) -> LoggedNode:
        node = LoggedNode(key=len(self.nodes), **fields)
        self.nodes.append(node)
        return node

    def children(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for node in self.nodes:
            if node.parent is not None:
                out.setdefault(node.parent, []).append(node.key)
        return out

    def leaves(self) -> list[LoggedNode]:
        parents = {n.parent for n in self.nodes if n.parent is not None}
        return [n for n in self.nodes if n.key not in parents]

    def picked(self, picker: str, order: Callable[[LoggedNode], float]) -> list[LoggedNode]:
        """The leaves `picker` keeps. `order` is the commit order (the gateway's `seq` when
        the nodes could be matched to its table, else the driver's reply order).

        drop_retries (the gateway's default hook) drops a leaf that has a later sibling off
        the same parent; a root leaf has no siblings and is kept, so an abandoned retry of a
        session's first turn (a second root) stays a sample.
        """
        leaves = self.leaves()
        if picker == "keep_all":
            return leaves
        children = self.children()
        kept = []
        for leaf in leaves:
            if leaf.parent is None:
                kept.append(leaf)
                continue
            siblings = (self.nodes[k] for k in children[leaf.parent] if k != leaf.key)
            if not any(order(s) > order(leaf) for s in siblings):
                kept.append(leaf)
        return kept

    def path(self, node: LoggedNode) -> list[LoggedNode]:
        """Root-to-node."""
        out = [node]
        while (parent := out[-1].parent) is not None:
            out.append(self.nodes[parent])
        out.reverse()
        return out

    def path_messages(self, node: LoggedNode) -> list[dict[str, Any]]:
        """The conversation a leaf's sample covers: its request's messages and its reply."""
        return [*node.messages, node.reply]


def completion_ids_of(document: dict[str, Any] | None) -> list[int] | None:
    """Sampled ids from a non-stream reply's `meta_info.output_token_logprobs`."""
    if document is None:
        return None
    try:
        entries: Sequence[Any] = document["choices"][0]["meta_info"]["output_token_logprobs"]
        return [int(entry[1]) for entry in entries]
    except (KeyError, IndexError, TypeError, ValueError):
        return None

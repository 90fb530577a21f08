"""Trajectory trees (`session_mode = "tree"`, docs/trajectory-trees.md): a session as a
forest of generations that may branch at any depth.

Each committed turn is one node under the node it attached to. A node keeps what no other
node holds: the messages its turn added (the client's, then the assistant's), the token ids
it added past its parent's checkpoint (prompt tail + completion) and the index of its record
in `Session.records`. A checkpoint (the root-to-node token snapshot) is its path's segments
joined, so every token and every record byte is stored once however many leaves share it.

Rules taken from the rollout framework (radixark/miles,
miles/rollout/session/v2/tree_trajectory.py and session_state.py):
- `seq` (commit order) is the only ordering key; here a node's `id` is its seq.
- A session holds at most MAX_NODES (1024) nodes.
- The attach point is the deepest node whose whole path messages are a prefix of the
  request's messages; a node is entered only once its parent's delta is fully consumed;
  ties on depth go to the latest seq. No such node: the turn starts a new root.
- A path cut off at the length limit (finish reason "length") cannot be extended (409).
- Concurrent turns attached at the same node become siblings, never a conflict.
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sessiongate.errors import Conflict
from sessiongate.session.messages import Message, MessageMatcher, check_appended

# The framework's cap (tree_trajectory.py, MAX_NODES): a session that needs more is almost
# always a client that does not replay its history verbatim.
MAX_NODES = 1024
# The reply's `id` is read only when it is the reply's first member (SGLang and
# OpenAI-compatible servers write it so): a cheap look at the first bytes, no parse.
_LEADING_ID = re.compile(rb'\s*\{\s*"id"\s*:\s*"([^"\\]{0,256})"')


@dataclass(slots=True, eq=False)
class TreeNode:
    """One committed generation. Immutable once created, but for `children`."""

    id: int  # seq: commit order within the session, and its record's index
    parent: TreeNode | None
    delta_messages: list[Message]  # what this turn added: appended messages, then the reply
    segment: array[int]  # int64 ids past the parent's checkpoint: prompt tail + completion
    prompt_len: int  # the turn's whole prompt (its completion starts here)
    checkpoint_len: int  # root-to-node ids: the parent's checkpoint + segment
    depth: int  # nodes on the root-to-node path (1 for a root)
    messages_end: int  # messages on the root-to-node path
    finish_reason: str
    response_id: str  # the upstream reply's id: how an agent joins its branch to a leaf
    committed_at: float  # wall clock, for people; never an ordering key
    tools: Any  # the tools and template variables the turn rendered with
    template_kwargs: dict[str, Any]
    children: list[TreeNode] = field(default_factory=list)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    def path(self) -> list[TreeNode]:
        """Root to this node."""
        nodes: list[TreeNode] = []
        node: TreeNode | None = self
        while node is not None:
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        return nodes


def path_messages(node: TreeNode | None) -> list[Message]:
    return [m for n in node.path() for m in n.delta_messages] if node is not None else []


def checkpoint_of(node: TreeNode | None) -> array[int]:
    """The root-to-node token ids, joined from the path's segments (int64 memcpy each)."""
    ids: array[int] = array("q")
    if node is None:
        return ids
    for part in node.path():
        ids += part.segment
    return ids


def leading_id(body: bytes) -> str:
    """The reply's top-level `id` when it is the first member, else ""."""
    found = _LEADING_ID.match(body, 0, 512)
    return found.group(1).decode("utf-8", "replace") if found else ""


@dataclass(frozen=True)
class TreePlan:
    """Where a turn attaches and what it renders (phase 1 of a tree turn)."""

    attach: TreeNode | None  # None: a new root, rendered from scratch
    base_len: int  # messages on the attach node's path
    checkpoint_count: int  # nodes on that path (0: first turn)
    appended: list[Message]
    # The stored spelling of the attach path (a loose matcher may have accepted a
    # re-serialised echo), then the appended messages.
    messages: list[Message]
    base_ids: array[int]
    last_assistant: Message | None


class SessionTree:
    """The nodes of one session, in commit order, and the attach-point search."""

    def __init__(self) -> None:
        self.nodes: list[TreeNode] = []
        self.roots: list[TreeNode] = []
        # Turns past phase 1 that may add a node: they hold a place under the cap, so a
        # commit never finds the tree full after the upstream did the work.
        self.pending = 0

    @property
    def active(self) -> TreeNode | None:
        """The most recently committed node: its path is the session's single-chain view."""
        return self.nodes[-1] if self.nodes else None

    def leaves(self) -> list[TreeNode]:
        return [node for node in self.nodes if not node.children]

    def find_attach(
        self, requested: Sequence[Message], matcher: MessageMatcher
    ) -> tuple[TreeNode | None, int]:
        """The deepest node whose whole path messages are a prefix of `requested`, and how
        many messages that path holds ((None, 0) when not even a root matches)."""
        best: TreeNode | None = None
        best_end = -1
        wanted = len(requested)
        # Depth-first; a child is visited only when its parent's delta matched in full.
        stack: list[tuple[TreeNode, int]] = [(root, 0) for root in reversed(self.roots)]
        while stack:
            node, offset = stack.pop()
            end = offset + len(node.delta_messages)
            if end > wanted:
                continue  # the request ends inside this node's delta
            at = offset
            for message in node.delta_messages:
                if not matcher(message, requested[at]):
                    break
                at += 1
            if at < end:
                continue
            if end > best_end or (end == best_end and best is not None and node.id > best.id):
                best, best_end = node, end
            for child in reversed(node.children):
                stack.append((child, end))
        return best, max(best_end, 0)

    def plan_turn(
        self,
        requested: Sequence[Message],
        *,
        session_id: str,
        allowed_roles: frozenset[str],
        matcher: MessageMatcher,
    ) -> TreePlan:
        """Attach the request (BadRequest / Conflict change nothing)."""
        attach, matched = self.find_attach(requested, matcher)
        if attach is None:
            appended = list(requested)
            return TreePlan(None, 0, 0, appended, appended, array("q"), None)
        if attach.truncated:
            raise Conflict(
                f"session {session_id}: the request extends node {attach.id}, whose generation "
                "was cut off at the length limit (finish_reason 'length'); a truncated path "
                "cannot be extended: retry from before the cut (resend the history without "
                "that assistant message)"
            )
        appended = list(requested[matched:])
        check_appended(
            appended,
            matched,
            allowed_roles,
            session_id=session_id,
            after=f"node {attach.id}'s assistant turn (its path has {matched} messages)",
        )
        stored = path_messages(attach)
        return TreePlan(
            attach=attach,
            base_len=matched,
            checkpoint_count=attach.depth,
            appended=appended,
            messages=[*stored, *appended],
            base_ids=checkpoint_of(attach),
            last_assistant=stored[-1],
        )

    def check_room(self, session_id: str) -> None:
        """Conflict (409) when one more node would pass the cap, counting turns in flight
        (the caller then adds itself to `pending` until its turn ends)."""
        if len(self.nodes) + self.pending >= MAX_NODES:
            in_flight = f" and {self.pending} turns in flight" if self.pending else ""
            raise Conflict(
                f"session {session_id} holds {len(self.nodes)} tree nodes{in_flight}, the "
                f"limit is {MAX_NODES} per session (MAX_NODES): it cannot branch or extend "
                "further. This usually means the client does not replay its history "
                "verbatim; start a new session"
            )

    def add(
        self,
        parent: TreeNode | None,
        *,
        delta_messages: list[Message],
        segment: array[int],
        prompt_len: int,
        finish_reason: str,
        response_id: str,
        committed_at: float,
        tools: Any,
        template_kwargs: dict[str, Any],
    ) -> TreeNode:
        if len(self.nodes) >= MAX_NODES:  # check_room() keeps commits below it
            raise Conflict(f"the tree already holds {MAX_NODES} nodes (MAX_NODES)")
        node = TreeNode(
            id=len(self.nodes),
            parent=parent,
            delta_messages=delta_messages,
            segment=segment,
            prompt_len=prompt_len,
            checkpoint_len=(parent.checkpoint_len if parent else 0) + len(segment),
            depth=(parent.depth if parent else 0) + 1,
            messages_end=(parent.messages_end if parent else 0) + len(delta_messages),
            finish_reason=finish_reason,
            response_id=response_id,
            committed_at=committed_at,
            tools=tools,
            template_kwargs=template_kwargs,
        )
        self.nodes.append(node)
        if parent is None:
            self.roots.append(node)
        else:
            parent.children.append(node)
        return node


def leaf_descriptor(leaf: TreeNode) -> dict[str, Any]:
    """A leaf as the framework's hooks read it (`sample.metadata["leaf"]`)."""
    return {
        "node_id": leaf.id,
        "parent": leaf.parent.id if leaf.parent is not None else None,
        "path_node_ids": [node.id for node in leaf.path()],
        "response_id": leaf.response_id,
    }


def describe_tree(nodes: Sequence[TreeNode]) -> dict[str, Any]:
    """`metadata.tree`: the node table (the framework's fields, plus `checkpoint_len` and
    `finish_reason`), the leaves with their paths, and the active node."""
    table = [
        {
            "id": node.id,
            "parent": node.parent.id if node.parent is not None else None,
            "seq": node.id,
            "checkpoint_len": node.checkpoint_len,
            "finish_reason": node.finish_reason,
            "truncated": node.truncated,
            "committed_at": node.committed_at,
            "completion_span": [node.prompt_len, node.checkpoint_len],
            "num_tokens": node.checkpoint_len,
            "response_id": node.response_id,
        }
        for node in nodes
    ]
    leaves = [
        {"node_id": node.id, "path_node_ids": [n.id for n in node.path()]}
        for node in nodes
        if not node.children
    ]
    return {"nodes": table, "leaves": leaves, "active": nodes[-1].id if nodes else None}

"""The approximate prefix tree of cache_aware: one radix tree whose nodes record which
engines were sent the prefix ending there, and when, and which of them answered a request
carrying it (`prefilled`: the engine has computed it, so it sits in its cache).

Units are characters (a `str`) or token ids (a `list[int]`); one tree holds one kind. An
engine present at a node is present at every ancestor (inserts mark the whole path, trims
remove leaves first), so the engines at the deepest node a prompt reaches all hold the whole
matched prefix. Times are a counter of inserts, not a clock: the order is all that matters
and both twins must agree on it. Node ids (creation order) break no real tie but make the
trim order total.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from itertools import count

from sessiongate.engines.policy.base import Units


class Node:
    __slots__ = ("children", "edge", "id", "parent", "prefilled", "tenants")

    def __init__(self, edge: Units, parent: Node | None, node_id: int) -> None:
        self.edge = edge
        self.parent = parent
        self.id = node_id
        self.children: dict[object, Node] = {}
        # engine -> time of the last insert through this node for it
        self.tenants: dict[int, int] = {}
        # The tenants that answered a request whose prompt ran through the whole node.
        self.prefilled: set[int] = set()


def shared(edge: Units, units: Units, start: int) -> int:
    """How many leading units of `edge` equal `units[start:]`'s."""
    end = start + len(edge)
    if units[start:end] == edge:
        return len(edge)
    limit = min(len(edge), len(units) - start)
    n = 0
    while n < limit and edge[n] == units[start + n]:
        n += 1
    return n


class PrefixTree:
    def __init__(self, engines: int, ids: count[int]) -> None:
        self.ids = ids
        self.root = Node("", None, next(ids))
        self.size = [0] * engines  # units held per engine

    def match(self, units: Units) -> list[tuple[int, Node]]:
        """The nodes `units` runs through, each with the units matched down to it (deepest
        last; the last edge may be matched in part)."""
        path: list[tuple[int, Node]] = []
        node, i = self.root, 0
        while i < len(units):
            child = node.children.get(units[i])
            if child is None:
                break
            common = shared(child.edge, units, i)
            i += common
            path.append((i, child))
            if common < len(child.edge):
                break
            node = child
        return path

    def insert(self, units: Units, engine: int, now: int) -> int:
        """Record that `engine` was sent `units`; the units it newly holds."""
        node, i, added = self.root, 0, 0
        while i < len(units):
            first = units[i]
            child = node.children.get(first)
            if child is None:
                leaf = Node(units[i:], node, next(self.ids))
                leaf.tenants[engine] = now
                node.children[first] = leaf
                added += len(units) - i
                break
            common = shared(child.edge, units, i)
            if common < len(child.edge):
                # Split: the shared part becomes a node of its own, held by the same engines.
                middle = Node(child.edge[:common], node, next(self.ids))
                middle.tenants = dict(child.tenants)
                middle.prefilled = set(child.prefilled)
                child.edge = child.edge[common:]
                child.parent = middle
                middle.children[child.edge[0]] = child
                node.children[first] = middle
                child = middle
            if engine not in child.tenants:
                added += len(child.edge)
            child.tenants[engine] = now
            i += len(child.edge)
            node = child
        self.size[engine] += added
        return added

    def held(self, units: Units, engine: int) -> int:
        """The units of `units` that `engine` holds: down to the deepest node on their path
        it prefilled."""
        for matched, node in reversed(self.match(units)):
            if engine in node.prefilled:
                return matched
        return 0

    def mark_prefilled(self, units: Units, engine: int) -> None:
        """`engine` answered a request with prompt `units`: the nodes the prompt runs through
        whole, where the engine is a tenant, are prefilled there."""
        start = 0
        for matched, node in self.match(units):
            if matched - start < len(node.edge) or engine not in node.tenants:
                break
            node.prefilled.add(engine)
            start = matched

    def _is_leaf_of(self, node: Node, engine: int) -> bool:
        return engine in node.tenants and not any(
            engine in child.tenants for child in node.children.values()
        )

    def evict(self, engine: int, max_size: int) -> int:
        """Drop `engine`'s least recently used leaves until it holds at most `max_size`
        units; the units dropped."""
        if self.size[engine] <= max_size:
            return 0
        heap: list[tuple[int, int, Node]] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if engine not in node.tenants:
                continue
            if self._is_leaf_of(node, engine):
                heap.append((node.tenants[engine], node.id, node))
            stack.extend(node.children.values())
        heapq.heapify(heap)
        dropped = 0
        while heap and self.size[engine] > max_size:
            _, _, node = heapq.heappop(heap)
            del node.tenants[engine]
            node.prefilled.discard(engine)
            self.size[engine] -= len(node.edge)
            dropped += len(node.edge)
            parent = node.parent
            if not node.tenants and parent is not None:
                del parent.children[node.edge[0]]
            if parent is not None and parent is not self.root and self._is_leaf_of(parent, engine):
                heapq.heappush(heap, (parent.tenants[engine], parent.id, parent))
        return dropped


def total_sizes(trees: Sequence[PrefixTree], engines: int) -> list[int]:
    return [sum(tree.size[e] for tree in trees) for e in range(engines)]

"""cache_aware: follow the engines' prefix caches while the load is balanced.

The SGLang Model Gateway's default policy, as `cache_aware_gateway`, and sessiongate's
refinement of it, as `cache_aware`. Both keep an approximate prefix tree of what each engine
was sent (`tree.py`) and decide alike:

- the candidates are imbalanced when max - min > balance_abs_threshold AND
  max > balance_rel_threshold * min (requests in flight): the least loaded one wins (the
  lowest index on a tie);
- else the prompt's longest prefix match: when more than `cache_threshold` of it matches,
  the engine holding that prefix, else the engine holding the fewest units;

and record the prompt as sent to the chosen engine. `evict` trims every engine's tree to
`max_tree_size` units, least recently used leaves first.

Where `cache_aware` departs from the Gateway:
- token ids are matched as ids (the Gateway matches the characters of their decimal
  printing, so "12 3" and "123" share a prefix and a match ratio counts digits);
- one tree per (ids or text, adapter, extra_key): an engine caches each LoRA adapter and
  each `extra_key` apart, so a prefix sent with another adapter is no cache hit;
- engines with an equal best match are told apart by requests in flight (then index), and
  so are engines with equally small trees; the Gateway sends such ties to whichever engine
  touched the prefix last (or the first smallest), which piles a shared system prompt's
  traffic onto one engine;
- only healthy engines' prefixes count: the match falls back to the deepest prefix a
  healthy engine holds, where the Gateway sends the request to its first healthy engine.
"""

from __future__ import annotations

from itertools import count

from sessiongate.engine_routing.config import EngineRoutingConfig
from sessiongate.engine_routing.policies.base import (
    EngineStates,
    KeyMaterial,
    RoutingRequest,
    Units,
    least,
)
from sessiongate.engine_routing.policies.tree import PrefixTree

TreeKey = tuple[bool, str | None, str | None]


def gateway_units(material: KeyMaterial) -> str:
    """The Gateway's routing text: the text, else the token ids printed and space-joined."""
    if material.text or material.ids is None:
        return material.text
    return " ".join(map(str, material.ids))


class CacheAware:
    def __init__(self, config: EngineRoutingConfig, engines: int, *, gateway: bool) -> None:
        self.name = "cache_aware_gateway" if gateway else "cache_aware"
        self.gateway = gateway
        self.threshold = config.cache_threshold
        self.balance_abs = config.balance_abs_threshold
        self.balance_rel = config.balance_rel_threshold
        self.max_tree_size = config.max_tree_size
        self.engines = engines
        self.trees: dict[TreeKey, PrefixTree] = {}
        self.total = [0] * engines  # units held per engine, over all trees
        self.clock = 0
        self.ids = count()

    def _tree(self, key: TreeKey) -> PrefixTree:
        tree = self.trees.get(key)
        if tree is None:
            tree = self.trees[key] = PrefixTree(self.engines, self.ids)
        return tree

    def _key(self, material: KeyMaterial) -> tuple[TreeKey, Units]:
        if self.gateway:
            return (False, None, None), gateway_units(material)
        if material.ids is not None:
            return (True, material.adapter, material.extra_key), material.ids
        return (False, material.adapter, material.extra_key), material.text

    def pick(self, request: RoutingRequest, engines: EngineStates) -> int:
        candidates = engines.candidates()
        tree_key, units = self._key(request.material)
        tree = self._tree(tree_key)
        loads = [engines.in_flight[i] for i in candidates]
        low, high = min(loads), max(loads)
        imbalanced = high - low > self.balance_abs and high > low * self.balance_rel
        if imbalanced:
            chosen = least(candidates, engines.in_flight)[0]
        elif self.gateway:
            chosen = self._gateway_choice(tree, units, candidates)
            if chosen not in candidates:
                # The Gateway sends the request to its first healthy engine, unrecorded.
                return candidates[0]
        else:
            chosen = self._choice(tree, units, candidates, engines)
        self.clock += 1
        self.total[chosen] += tree.insert(units, chosen, self.clock)
        return chosen

    def _gateway_choice(self, tree: PrefixTree, units: Units, candidates: list[int]) -> int:
        path = tree.match(units)
        if path and path[-1][0] / len(units) > self.threshold:
            tenants = path[-1][1].tenants
            return max(tenants, key=tenants.__getitem__)  # the last engine sent this prefix
        return least(candidates, self.total)[0]

    def _choice(
        self, tree: PrefixTree, units: Units, candidates: list[int], engines: EngineStates
    ) -> int:
        for matched, node in reversed(tree.match(units)):
            holders = [i for i in candidates if i in node.tenants]
            if holders:
                if matched / len(units) > self.threshold:
                    return least(holders, engines.in_flight)[0]
                break
        smallest = least(candidates, self.total)
        return least(smallest, engines.in_flight)[0]

    def evict(self, now: float) -> None:
        for tree in self.trees.values():
            for engine in range(self.engines):
                self.total[engine] -= tree.evict(engine, self.max_tree_size)

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
- below the Gateway's imbalance override, the engine is not "the holder of the longest
  match" but the candidate of least cost, where an engine's cost is the work it has in
  flight (`EngineStates.work`: the uncached units of its requests in flight, as estimated
  when each was picked) plus PREFILL_WEIGHT times the units this request would prefill
  there (its length minus what the engine holds of it; a match at or below
  `cache_threshold` of the prompt counts as none). Ties go to fewer requests in flight,
  then the smaller tree, then the lower index. So a GRPO group stays on the engine that
  holds its prompt while that engine's backlog exceeds another's by less than four times
  the prompt's prefill there, and a shared system prompt no longer pulls every request onto
  one engine: the Gateway's rule (follow any match over the threshold while in-flight counts
  differ by under 64) sent every multi-turn agent of the routing-quality bench to one engine;
- only healthy engines' prefixes count;
- a prefix counts as held by an engine once the engine has answered a request carrying it
  (`prefilled`, told by the pools), not from the moment it was sent, except the whole prompt
  (a GRPO sample whose group's prompt went there: the pools hold siblings until one prefill
  of it, engines/siblings.py). A prefix sent but not yet computed is in no cache: requests
  sharing it that reach the engine before it is computed are admitted in one step and each
  prefills it. On the routing-quality bench's multi-turn variant the tree sent a few
  agents arriving together to the engine just sent the shared system prompt, and each
  prefilled it; counted from the answer, they spread over the engines, each of which
  computes it once;
- a reply whose `cached_tokens` falls more than CACHED_SLACK short of what the engine was
  believed at the pick to hold of the prompt (`held`, `cached`) shows the engine evicted:
  the tree forgets as many of the engine's least recently used units, never the answered
  prompt's (docs/routing.md, "What a reply's cached_tokens teaches").

Why PREFILL_WEIGHT is 4: with 1 the cost is this request's own finish time, and a second
sample of a group arriving while the first still prefills ties with an idle engine that must
prefill the whole prompt again, a copy that takes capacity every later request waits for.
On the routing-quality bench (docs/performance.md) weights 2, 4 and 8 traded hit rate for
balance within that bench's run-to-run noise (GRPO hit rate 0.76-0.81, work imbalance
1.2-1.5; multi-turn 0.79-0.82 and 1.1-1.3); 4 kept every multi-turn agent on its engine
with the best balance seen.
"""

from __future__ import annotations

from itertools import count

from sessiongate.config.engines import EngineRoutingConfig
from sessiongate.engines.policy.base import (
    EngineStates,
    KeyMaterial,
    RoutingRequest,
    Units,
    least,
)
from sessiongate.engines.policy.prefix_tree import PrefixTree

TreeKey = tuple[bool, str | None, str | None]

# What a unit to prefill costs against a unit of work in flight (the docstring says why 4).
PREFILL_WEIGHT = 4
# How far below the units an engine was believed to hold a reply's `cached_tokens` may be
# before the belief counts as wrong: SGLang never serves a prompt's last token from the
# cache, and with a page size above 1 it matches whole pages only (up to 64 tokens).
CACHED_SLACK = 64


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
        if self.gateway:
            if imbalanced:
                chosen = least(candidates, engines.in_flight)[0]
            else:
                chosen = self._gateway_choice(tree, units, candidates)
                if chosen not in candidates:
                    # The Gateway sends the request to its first healthy engine, unrecorded.
                    return candidates[0]
        else:
            uncached = self._uncached(tree, units, candidates)
            if imbalanced:
                chosen = least(candidates, engines.in_flight)[0]
            else:
                chosen = min(candidates, key=lambda i: self._cost(i, uncached[i], engines))
            # Counted from the pick: the caller reports the request's start right after.
            engines.work[chosen] += uncached[chosen] + 1
        self.clock += 1
        self.total[chosen] += tree.insert(units, chosen, self.clock)
        return chosen

    def record(self, index: int, request: RoutingRequest, engines: EngineStates) -> None:
        """`request` went to engine `index` without a pick (a pinned session family's
        turn): learn it as a pick of `index` would."""
        tree_key, units = self._key(request.material)
        tree = self._tree(tree_key)
        if not self.gateway:
            engines.work[index] += self._uncached(tree, units, [index])[index] + 1
        self.clock += 1
        self.total[index] += tree.insert(units, index, self.clock)

    def _gateway_choice(self, tree: PrefixTree, units: Units, candidates: list[int]) -> int:
        path = tree.match(units)
        if path and path[-1][0] / len(units) > self.threshold:
            tenants = path[-1][1].tenants
            return max(tenants, key=tenants.__getitem__)  # the last engine sent this prefix
        return least(candidates, self.total)[0]

    def _uncached(self, tree: PrefixTree, units: Units, candidates: list[int]) -> dict[int, int]:
        """The units each candidate would prefill: the prompt less the deepest prefix the
        engine holds, when that is over `cache_threshold` of the prompt. An engine holds what
        it prefilled (answered a request carrying it), or the whole prompt once sent it
        (a sibling: the pool has it prefilled once there)."""
        uncached = dict.fromkeys(candidates, len(units))
        seen: set[int] = set()
        path = tree.match(units)
        whole = bool(path) and path[-1][0] == len(units)
        for depth, (matched, node) in enumerate(reversed(path)):
            for i in candidates:
                if i in seen or i not in node.tenants:
                    continue
                if not (depth == 0 and whole) and i not in node.prefilled:
                    continue
                seen.add(i)
                if matched / len(units) > self.threshold:
                    uncached[i] = len(units) - matched
        return uncached

    def prefilled(self, index: int, request: RoutingRequest) -> None:
        """Engine `index` answered `request`: its prompt is in the engine's cache."""
        if self.gateway:
            return
        tree_key, units = self._key(request.material)
        tree = self.trees.get(tree_key)
        if tree is not None:
            tree.mark_prefilled(units, index)

    def held(self, index: int, request: RoutingRequest) -> int | None:
        """Units of `request`'s prompt engine `index` is believed to hold (what it
        prefilled); None unless the tree counts token ids, the unit of `cached_tokens`."""
        material = request.material
        if self.gateway or material.ids is None:
            return None
        tree = self.trees.get(self._key(material)[0])
        return 0 if tree is None else tree.held(material.ids, index)

    def cached(self, index: int, request: RoutingRequest, held: int, cached: int) -> int:
        """Engine `index` answered `request` with `cached` prompt tokens from its cache,
        where it was believed at the pick to hold `held`: when that is more than
        CACHED_SLACK short, the engine lost at least `held - cached` units, and as many
        of its least recently used units leave the tree (SGLang's own eviction order),
        never the prompt's own (the engine has just computed it). The units learned lost,
        0 when none."""
        if held <= cached + CACHED_SLACK or self.gateway or request.material.ids is None:
            return 0
        tree_key, units = self._key(request.material)
        tree = self.trees.get(tree_key)
        if tree is not None:
            # The prompt is the engine's most recently used now, so the least recently
            # used units that go for what it lost are never the prompt's own.
            self.clock += 1
            self.total[index] += tree.insert(units, index, self.clock)
            keep = max(tree.size[index] - (held - cached), len(units))
            self.total[index] -= tree.evict(index, keep)
        return held - cached

    def _cost(self, i: int, uncached: int, engines: EngineStates) -> tuple[int, int, int, int]:
        return (
            engines.work[i] + PREFILL_WEIGHT * uncached,
            engines.in_flight[i],
            self.total[i],
            i,
        )

    def evict(self, now: float) -> None:
        for tree in self.trees.values():
            for engine in range(self.engines):
                self.total[engine] -= tree.evict(engine, self.max_tree_size)

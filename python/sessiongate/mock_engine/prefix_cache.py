"""A small stand-in for SGLang's radix cache, so `cached_tokens` means what it means there.

SGLang reports in `meta_info.cached_tokens` how many leading prompt tokens it found in its
radix cache. Finished requests leave their prompt and output tokens there (all but the last
sampled token, which never had its KV computed), and a match never covers the whole prompt:
at least the last prompt token is computed again (`Req.adjust_max_prefix_ids`).

The mock keeps finished sequences in LRU order under a token budget. Lookup is by a chain of
hashes over fixed-size blocks (block k's hash covers tokens `[0, (k+1)*B)`), so a lookup
costs one pass of hashing over the prompt, and then at most one block of token comparisons
against a sequence that shares the matched blocks. Evicting a sequence drops its blocks.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

BLOCK = 32  # tokens per hashed block


@dataclass(slots=True)
class _Entry:
    ids: array[int]
    hashes: list[int]
    first: tuple[str, int] | None


class PrefixCache:
    """LRU of token sequences with a longest-cached-prefix lookup; safe across threads."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        # Chain hash of a block prefix -> ids of the entries holding it (insertion ordered).
        self._blocks: dict[int, dict[int, None]] = {}
        # Sequences shorter than a block are found by (namespace, first token).
        self._first: dict[tuple[str, int], int] = {}
        self._tokens = 0
        self._next_id = 0
        self._lock = threading.Lock()

    @staticmethod
    def _chain(namespace: str, ids: Sequence[int]) -> list[int]:
        data = array("i", ids).tobytes()
        step = BLOCK * 4
        h = hash(("sg-mock-prefix", namespace))
        out: list[int] = []
        for k in range(len(ids) // BLOCK):
            h = hash((h, data[k * step : (k + 1) * step]))
            out.append(h)
        return out

    def _match_locked(self, namespace: str, ids: Sequence[int], hashes: list[int]) -> int:
        matched, owners = 0, None
        for k, h in enumerate(hashes):
            found = self._blocks.get(h)
            if not found:
                break
            matched, owners = (k + 1) * BLOCK, found
        candidate: _Entry | None = None
        if owners:
            candidate = self._entries[next(reversed(owners))]
        elif ids:
            entry_id = self._first.get((namespace, ids[0]))
            candidate = None if entry_id is None else self._entries[entry_id]
        if candidate is None:
            return matched
        limit = min(len(ids), len(candidate.ids), matched + BLOCK)
        while matched < limit and ids[matched] == candidate.ids[matched]:
            matched += 1
        return matched

    def match(self, prompt: Sequence[int], namespace: str = "", limit: int | None = None) -> int:
        """Cached prompt tokens for `prompt` at schedule time: at most `len(prompt) - 1`
        (and at most `limit`, SGLang's `_compute_max_prefix_len` with a logprob start)."""
        hashes = self._chain(namespace, prompt)
        with self._lock:
            cached = min(self._match_locked(namespace, prompt, hashes), len(prompt) - 1)
            if limit is not None:
                cached = min(cached, limit)
            return max(0, cached)

    def insert(self, sequence: Sequence[int], namespace: str = "") -> None:
        """Remember `sequence` (a finished prefill's prompt, or a finished request's prompt
        and output but the last token), evicting least recently used sequences over budget."""
        if not sequence or self.max_tokens <= 0:
            return
        hashes = self._chain(namespace, sequence)
        with self._lock:
            self._remember_locked(namespace, sequence, hashes)

    def flush(self) -> None:
        """Forget everything (SGLang's `/flush_cache` resets the radix tree)."""
        with self._lock:
            self._entries.clear()
            self._blocks.clear()
            self._first.clear()
            self._tokens = 0

    def lookup_and_insert(
        self, prompt: Sequence[int], sequence: Sequence[int], namespace: str = ""
    ) -> int:
        """Cached prompt tokens for `prompt` (at most `len(prompt) - 1`), then remember
        `sequence` (what the finished request leaves in the cache)."""
        prompt_hashes = self._chain(namespace, prompt)
        seq_hashes = self._chain(namespace, sequence)
        with self._lock:
            cached = min(self._match_locked(namespace, prompt, prompt_hashes), len(prompt) - 1)
            if sequence and self.max_tokens > 0:
                self._remember_locked(namespace, sequence, seq_hashes)
            return max(0, cached)

    def _remember_locked(self, namespace: str, sequence: Sequence[int], hashes: list[int]) -> None:
        if self._match_locked(namespace, sequence, hashes) == len(sequence):
            # Already cached: refresh the holder of its last block (LRU touch).
            holders = self._blocks.get(hashes[-1]) if hashes else None
            if holders:
                self._entries.move_to_end(next(reversed(holders)))
        else:
            self._insert_locked(namespace, sequence, hashes)

    def _insert_locked(self, namespace: str, sequence: Sequence[int], hashes: list[int]) -> None:
        entry_id = self._next_id
        self._next_id += 1
        first = (namespace, sequence[0])
        self._entries[entry_id] = _Entry(array("i", sequence), hashes, first)
        for h in hashes:
            self._blocks.setdefault(h, {})[entry_id] = None
        self._first[first] = entry_id
        self._tokens += len(sequence)
        while self._tokens > self.max_tokens and self._entries:
            old_id, old = self._entries.popitem(last=False)
            self._tokens -= len(old.ids)
            for h in old.hashes:
                holders = self._blocks.get(h)
                if holders is not None:
                    holders.pop(old_id, None)
                    if not holders:
                        del self._blocks[h]
            if old.first is not None and self._first.get(old.first) == old_id:
                del self._first[old.first]

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"sequences": len(self._entries), "tokens": self._tokens}

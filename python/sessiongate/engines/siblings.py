"""Siblings: requests with one prompt on one engine at once, prefilled there once.

SGLang's default schedule (`fcfs`) matches each request against the engine's prefix cache when
the request is admitted to a prefill step, and the cache is filled only when that step
completes: requests admitted in one step do not see each other's prompts. A GRPO group is n
requests with one prompt sent together; routed to one engine (as cache_aware keeps them), most
are admitted in the same step and each prefills the whole prompt. On the routing-quality bench
(docs/performance.md) that was what kept every router's GRPO hit rate at 0.76-0.84 against a
bound of 0.91.

So the pool holds them: the first request with a prompt on an engine (its lead) goes at once,
unless leads are held (below). A second one arriving while the lead is in flight is a
sibling: the pool sends the engine one warm-up, a prefill-only copy of the prompt
(`max_new_tokens: 0`, SGLang's prefill-only request: it finishes when its prefill does,
leaving the prompt in the radix cache), and every sibling waits for it, then goes and finds
the prompt cached. A warm-up of token ids leaves out the last id: SGLang recomputes a
prompt's last token whatever is cached (`cached_tokens` <= prompt - 1), so warming it would
be paid twice. Text is warmed whole (the text without its last character need not tokenize
to a prefix of the prompt's tokens). The warm-up is sent once per prompt and engine while
requests with that prompt are in flight there; once it has answered, later siblings go at
once. If the lead was admitted before the warm-up, the warm-up itself finds the prompt
cached and costs one token; if they share a step, one extra prefill instead of n - 1.

A lead can share a step with its warm-up: when the lead waits in a busy engine's queue and
its siblings arrive before it is admitted, the lead and the warm-up are admitted together and
the prompt is prefilled twice (on the routing-quality bench, most of what was left between
the GRPO hit rate and its bound). So when prompts have been arriving in groups (more than
half of the last eight or so prompts had a sibling: `grouped`, a moving average), a lead is
held as well: it sends the warm-up itself and waits for it like a sibling. The average starts
at LEAD_HOLD_FROM (a held lone lead loses its warm-up's round trip and, on a busy engine, one
engine step; a group's lead not held costs a second prefill); prompts that come alone
(multi-turn agents' turns, each one new) bring it below at the first that ends alone, and
keep it near 0. On the routing-quality bench the GRPO hit rate was 0.878-0.885 with only
siblings held and 0.899-0.910 with leads on busy engines held too (bound 0.913); starting
the average at 0 instead, 0.883-0.896.

Different prompts share a prefix too (a system prompt): held leads whose warm-ups are
admitted in one step each prefill it. So a held lead whose prompt shares at least
SIBLING_MIN_UNITS more leading units with a prompt being warmed up on its engine than with
any prompt warmed there and still in flight follows that warm-up: it waits for it, then
sends its own warm-up (when siblings joined it meanwhile) or goes, finding the shared prefix
cached. The prompts held this way are the first burst's: a multi-turn rollout's first turns
(every agent's prompt new, `grouped` still undecided) and each GRPO step's first groups after
a weight update. On the routing-quality bench the multi-turn first turns had cost the system
prompt 17 prefills on four engines where one per engine is the bound (hit rate 0.784-0.832,
bound 0.832); following, the run pays the bound to the token, six runs out of six.

What counts: POST `/generate` with `input_ids` (a list of token ids) or `text` (a string) of at
least SIBLING_MIN_UNITS units; one prompt is the same ids or text with the same `lora_path` and
`extra_key` (the engine caches per adapter and per key). A warm-up that fails (any status, a
transport error) or takes more than WARMUP_WAIT_S releases its siblings all the same: the
hold only ever saves work, it never refuses a request. `--no-hold-siblings` turns it off.

This is the specification; `rust/front/siblings.rs` is its compiled twin.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

# Shorter prompts prefill faster than a sibling would wait for the warm-up's round trip.
SIBLING_MIN_UNITS = 64
# A sibling's wait for its warm-up, at most (then it goes: a slow warm-up is an engine's
# queue, which the sibling would wait in anyway).
WARMUP_WAIT_S = 30.0
GENERATE_PATH = "/generate"
# Each prompt's weight in `grouped` (1/8: the estimate follows the last eight or so), and the
# estimate from which a lead is held too.
GROUPED_WEIGHT = 0.125
LEAD_HOLD_FROM = 0.5
# Token ids are non-negative integers below 2**64 (the compiled twin reads them as u64).
MAX_ID = 1 << 64

# (the prompt's kind: "ids" or "text", the ids or text, lora_path and extra_key as JSON text)
Key = tuple[str, tuple[int, ...] | str, str | None, str | None]
State = Literal["lead", "following", "warming", "warm"]
# What a request entering with a prompt does: send now, send the warm-up and wait for it,
# wait for the warm-up under way, or wait for another prompt's warm-up (then `resume`).
Role = Literal["go", "warm_up", "wait", "follow"]


def prompt_key(method: str, path: str, body: bytes) -> Key | None:
    """The prompt a request shares with its siblings, None when it has none that counts."""
    if method != "POST" or path != GENERATE_PATH:
        return None
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    ids = doc.get("input_ids")
    units: tuple[int, ...] | str
    if (
        isinstance(ids, list)
        and len(ids) >= SIBLING_MIN_UNITS
        and all(type(x) is int and 0 <= x < MAX_ID for x in ids)
    ):
        kind, units = "ids", tuple(ids)
    elif ids is None and isinstance(doc.get("text"), str) and len(doc["text"]) >= SIBLING_MIN_UNITS:
        kind, units = "text", doc["text"]
    else:
        return None
    return (kind, units, _as_text(doc, "lora_path"), _as_text(doc, "extra_key"))


def _as_text(doc: dict[str, object], name: str) -> str | None:
    """A field's JSON value as a hashable key part (None when absent or null)."""
    value = doc.get(name)
    return None if value is None else json.dumps(value, sort_keys=True)


def warmup_body(key: Key) -> bytes:
    """The warm-up for a prompt: the same prompt (ids without the last, which every request
    recomputes), adapter and extra_key, prefill only."""
    kind, units, lora_path, extra_key = key
    doc: dict[str, object] = {
        "input_ids" if kind == "ids" else "text": list(units[:-1]) if kind == "ids" else units,
        "sampling_params": {"max_new_tokens": 0},
    }
    for name, value in (("lora_path", lora_path), ("extra_key", extra_key)):
        if value is not None:
            doc[name] = json.loads(value)
    return json.dumps(doc, separators=(",", ":")).encode()


def shared_units(a: Key, b: Key) -> int:
    """How many leading ids (or characters) two prompts share in one cache namespace (the
    same kind, adapter and extra_key), 0 across namespaces."""
    if a[0] != b[0] or a[2:] != b[2:]:
        return 0
    x, y = a[1], b[1]
    # A binary search over slice comparisons: each runs in C, where a Python loop over the
    # units would cost ~40 ns a unit.
    lo, hi = 0, min(len(x), len(y))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if x[:mid] == y[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass
class _Prompt:
    in_flight: int = 1
    state: State = "lead"
    # A following prompt's anchor: the prompt whose warm-up it waits for.
    anchor: Key | None = None
    # Whether a second request came while this one was in flight: one observation of `grouped`.
    had_sibling: bool = False
    warmed: asyncio.Event = field(default_factory=asyncio.Event)


class Siblings:
    """One pool's prompts in flight per engine, and their warm-ups."""

    def __init__(self, enabled: bool = True, wait_secs: float = WARMUP_WAIT_S) -> None:
        self.enabled = enabled
        self.wait_secs = wait_secs
        self._prompts: dict[tuple[str, Key], _Prompt] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # The share of recent prompts that had siblings (a moving average), undecided at the
        # start: holding a lone lead costs it a round trip (on a busy engine, one step),
        # missing a group's lead costs a second prefill of its prompt, so the first leads are
        # held.
        self.grouped = LEAD_HOLD_FROM
        # /health's figures: siblings that waited, leads that waited (those that followed
        # another prompt's warm-up among them), warm-ups sent and warm-ups that failed.
        self.held = 0
        self.leads_held = 0
        self.leads_followed = 0
        self.warmups = 0
        self.failed = 0

    def key(self, method: str, path: str, body: bytes) -> Key | None:
        return prompt_key(method, path, body) if self.enabled else None

    def admit(self, engine: str, key: Key) -> Role:
        """The role of a request with prompt `key` going to `engine`. Pair with `leave`; a
        "warm_up" with `warmed`; a "follow" with `resume` once its anchor is warmed."""
        prompt = self._prompts.get((engine, key))
        if prompt is None:
            if self.grouped < LEAD_HOLD_FROM:
                self._prompts[(engine, key)] = _Prompt()
                return "go"
            self.leads_held += 1
            anchor = self._anchor(engine, key)
            if anchor is not None:
                self._prompts[(engine, key)] = _Prompt(state="following", anchor=anchor)
                self.leads_followed += 1
                return "follow"
            self._prompts[(engine, key)] = _Prompt(state="warming")
            self.warmups += 1
            return "warm_up"
        prompt.in_flight += 1
        if not prompt.had_sibling:
            prompt.had_sibling = True
            self._observe(1.0)
        if prompt.state == "lead":
            prompt.state = "warming"
            self.warmups += 1
            self.held += 1
            return "warm_up"
        if prompt.state in ("warming", "following"):
            self.held += 1
            return "wait"
        return "go"

    def _anchor(self, engine: str, key: Key) -> Key | None:
        """The prompt being warmed up on `engine` that a new lead should follow: the one
        sharing the most leading units with it, when that is SIBLING_MIN_UNITS more than it
        shares with any prompt warmed there (whose prefix the engine holds)."""
        best: Key | None = None
        warming = warm = 0
        for (at, other), prompt in self._prompts.items():
            if at != engine or prompt.state not in ("warming", "warm"):
                continue
            shared = shared_units(key, other)
            if prompt.state == "warm":
                warm = max(warm, shared)
            elif shared > warming:
                best, warming = other, shared
        return best if warming >= warm + SIBLING_MIN_UNITS else None

    def resume(self, engine: str, key: Key) -> Role:
        """A following lead's anchor is warmed (or gone): send its own warm-up when siblings
        joined it meanwhile, else go."""
        prompt = self._prompts.get((engine, key))
        if prompt is None or prompt.state != "following":
            return "go"
        prompt.anchor = None
        if prompt.had_sibling:
            prompt.state = "warming"
            self.warmups += 1
            return "warm_up"
        prompt.state = "lead"
        return "go"

    def _observe(self, grouped: float) -> None:
        self.grouped += (grouped - self.grouped) * GROUPED_WEIGHT

    def warmed(self, engine: str, key: Key, took: bool) -> None:
        """The warm-up answered (`took`: with a 200) or failed: release the waiting."""
        if not took:
            self.failed += 1
        prompt = self._prompts.get((engine, key))
        if prompt is not None:
            prompt.state = "warm"
            prompt.warmed.set()

    async def enter(
        self,
        engine: str,
        key: Key,
        warm_up: Callable[[bytes], Awaitable[bool]],
    ) -> None:
        """A request with prompt `key` goes to `engine` (its URL: an engine keeps its prompts
        across a change of the engine set): return when it may be sent.
        `warm_up(body)` sends a warm-up there and says whether the engine took it. Pair
        every `enter` with a `leave`, whatever happens in between."""
        role = self.admit(engine, key)
        if role == "follow":
            anchor = self._prompts[(engine, key)].anchor
            followed = self._prompts.get((engine, anchor)) if anchor is not None else None
            if followed is not None:
                await self._wait(followed)
            role = self.resume(engine, key)
        if role == "go":
            return
        prompt = self._prompts[(engine, key)]
        if role == "warm_up":
            task = asyncio.create_task(self._warm(engine, key, warm_up))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        await self._wait(prompt)

    async def _wait(self, prompt: _Prompt) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.wait_secs):
                await prompt.warmed.wait()

    async def _warm(
        self, engine: str, key: Key, warm_up: Callable[[bytes], Awaitable[bool]]
    ) -> None:
        try:
            took = await warm_up(warmup_body(key))
        except Exception:  # a gone engine: its requests find out for themselves
            took = False
        self.warmed(engine, key, took)

    def leave(self, engine: str, key: Key) -> None:
        prompt = self._prompts.get((engine, key))
        if prompt is None:
            return
        prompt.in_flight -= 1
        if prompt.in_flight <= 0:
            del self._prompts[(engine, key)]
            # Its waiters, if any are left, go (their requests left too, or timed out).
            prompt.warmed.set()
            if not prompt.had_sibling:
                self._observe(0.0)

    def stats(self) -> dict[str, int]:
        return {
            "siblings_held": self.held,
            "leads_held": self.leads_held,
            "leads_followed": self.leads_followed,
            "warmups": self.warmups,
            "warmups_failed": self.failed,
        }

"""What a bench run sends: session families as plain data, and the seeded synthetic generator.

A workload is a sequence of root `SessionSpec`s. A session is a list of turns; each turn
appends some non-assistant messages to the history, asks for a reply of at most
`max_tokens`, and may spawn child sessions (sub-agents) once its reply is in. Assistant
messages are never part of a spec: they come from the target at run time.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from sessiongate.mock_engine.generate import WORDS

# One tool definition sent with every request when the workload uses tools, so engines
# that make tool calls (the mock engine with --tool-call-rate) have something to call.
DEFAULT_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the knowledge base.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    }
]


@dataclass(slots=True)
class TurnSpec:
    """One request of a session."""

    messages: list[dict[str, Any]]  # appended to the history before this turn's request
    max_tokens: int
    delay_s: float = 0.0  # think time before this turn is sent
    children: list[SessionSpec] = field(default_factory=list)  # spawned after the reply
    wait_children: bool = True  # the next turn starts only once these children finished
    body: dict[str, Any] = field(default_factory=dict)  # extra request fields (temperature...)


@dataclass(slots=True)
class SessionSpec:
    """A session and, through its turns' children, its whole sub-agent tree."""

    id: str  # workload-local id ("s3", "s3.0", "s3.0.1"): shown in raw records as trace_id
    turns: list[TurnSpec]

    def walk(self) -> Iterator[tuple[SessionSpec, SessionSpec | None, int | None]]:
        """(session, parent, parent turn index) for this session and every descendant."""
        yield self, None, None
        stack: list[tuple[SessionSpec, SessionSpec, int]] = [
            (child, self, t) for t, turn in enumerate(self.turns) for child in turn.children
        ]
        stack.reverse()
        while stack:
            node, parent, t = stack.pop()
            yield node, parent, t
            below = [(c, node, i) for i, turn in enumerate(node.turns) for c in turn.children]
            stack.extend(reversed(below))

    def count(self) -> tuple[int, int]:
        """(sessions, turns) in this tree."""
        sessions = turns = 0
        for node, _, _ in self.walk():
            sessions += 1
            turns += len(node.turns)
        return sessions, turns


@dataclass(frozen=True, slots=True)
class SyntheticOptions:
    """Knobs of the synthetic generator (CLI flags of the same names; docs/bench.md)."""

    seed: int = 0
    turns: float = 4.0
    turns_stddev: float = 0.0
    system_tokens: int = 32
    prompt_tokens: int = 64
    append_messages: int = 1
    append_tokens: int = 32
    tool_ratio: float = 0.5  # share of appended messages that are tool results (else user)
    max_tokens: int = 32
    max_tokens_stddev: float = 0.0
    think_time: float = 0.0
    think_time_stddev: float = 0.0
    child_prob: float = 0.0  # per turn: probability that it spawns children
    fanout: int = 1  # children per spawning turn
    depth: int = 1  # deepest level of children (root = 0)
    max_spawns: int = 0  # spawning turns per session; 0 = no limit
    child_turns: float | None = None  # None: same as turns
    child_turns_stddev: float | None = None
    wait_children: bool = True

    def check(self) -> None:
        """Refuse impossible settings with a message naming the flag."""
        problems = []
        if self.turns < 1:
            problems.append("--turns must be >= 1")
        if self.child_turns is not None and self.child_turns < 1:
            problems.append("--child-turns must be >= 1")
        for name in ("turns_stddev", "max_tokens_stddev", "think_time", "think_time_stddev"):
            if getattr(self, name) < 0:
                problems.append(f"--{name.replace('_', '-')} must be >= 0")
        if self.child_turns_stddev is not None and self.child_turns_stddev < 0:
            problems.append("--child-turns-stddev must be >= 0")
        for name in ("system_tokens", "append_tokens", "max_spawns"):
            if getattr(self, name) < 0:
                problems.append(f"--{name.replace('_', '-')} must be >= 0")
        if self.append_messages < 1:
            problems.append("--append-messages must be >= 1 (a turn must add something)")
        if self.prompt_tokens < 1:
            problems.append("--prompt-tokens must be >= 1")
        if self.max_tokens < 1:
            problems.append("--max-tokens must be >= 1")
        if not 0.0 <= self.tool_ratio <= 1.0:
            problems.append("--tool-ratio must be in [0, 1]")
        if not 0.0 <= self.child_prob <= 1.0:
            problems.append("--child-prob must be in [0, 1]")
        if self.fanout < 1:
            problems.append("--fanout must be >= 1")
        if self.depth < 0:
            problems.append("--depth must be >= 0")
        if problems:
            raise ValueError("; ".join(problems))


def _words(rng: random.Random, count: int) -> str:
    # Common English words, about one token each with byte-level BPE tokenizers.
    return " ".join(rng.choice(WORDS) for _ in range(count))


def _count(rng: random.Random, mean: float, stddev: float, minimum: int) -> int:
    value = rng.gauss(mean, stddev) if stddev > 0 else mean
    return max(minimum, round(value))


def later_turn(rng: random.Random, o: SyntheticOptions) -> TurnSpec:
    """A turn after the first: appended tool results or user follow-ups, think time first.

    Shared with the tree workload, whose extra branches are made of such turns.
    """
    messages = [
        {
            "role": "tool" if rng.random() < o.tool_ratio else "user",
            "content": _words(rng, o.append_tokens),
        }
        for _ in range(o.append_messages)
    ]
    delay = max(0.0, rng.gauss(o.think_time, o.think_time_stddev))
    return TurnSpec(
        messages=messages,
        max_tokens=_count(rng, o.max_tokens, o.max_tokens_stddev, 1),
        delay_s=round(delay, 6),
        wait_children=o.wait_children,
    )


class SyntheticWorkload:
    """Root sessions from a seed: root i is the same tree whatever the run's length.

    Each root gets its own RNG seeded from (seed, i), so `--sessions 10` is a prefix of
    `--sessions 100` and a `--duration` run replays the same trees in the same order.
    """

    def __init__(self, options: SyntheticOptions) -> None:
        options.check()
        self.options = options

    def __iter__(self) -> Iterator[SessionSpec]:
        index = 0
        while True:
            yield self.root(index)
            index += 1

    def root(self, index: int) -> SessionSpec:
        rng = random.Random(f"sessiongate-bench|{self.options.seed}|{index}")
        return self._session(rng, f"s{index}", depth=0)

    def _session(self, rng: random.Random, sid: str, depth: int) -> SessionSpec:
        o = self.options
        if depth == 0 or o.child_turns is None:
            mean, stddev = o.turns, o.turns_stddev
        else:
            mean = o.child_turns
            stddev = o.turns_stddev if o.child_turns_stddev is None else o.child_turns_stddev
        n_turns = _count(rng, mean, stddev, 1)
        turns: list[TurnSpec] = []
        spawns = 0
        children_made = 0
        for t in range(n_turns):
            if t == 0:
                messages: list[dict[str, Any]] = []
                if o.system_tokens:
                    messages.append({"role": "system", "content": _words(rng, o.system_tokens)})
                messages.append(
                    {"role": "user", "content": f"Task {sid}: {_words(rng, o.prompt_tokens)}"}
                )
                turn = TurnSpec(
                    messages=messages,
                    max_tokens=_count(rng, o.max_tokens, o.max_tokens_stddev, 1),
                    wait_children=o.wait_children,
                )
            else:
                turn = later_turn(rng, o)
            may_spawn = depth < o.depth and (o.max_spawns == 0 or spawns < o.max_spawns)
            if may_spawn and o.child_prob > 0 and rng.random() < o.child_prob:
                spawns += 1
                for _ in range(o.fanout):
                    child_id = f"{sid}.{children_made}"
                    children_made += 1
                    turn.children.append(self._session(rng, child_id, depth + 1))
            turns.append(turn)
        return SessionSpec(sid, turns)

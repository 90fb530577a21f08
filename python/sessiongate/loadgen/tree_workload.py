"""Tree sessions: one session whose turns retry, fork and resume (`--session-mode tree`).

A tree session is a main line (the synthetic session of the same seed and index, without
sub-agents) plus, drawn from its own seeded RNG:

- **retries**: a turn is sent, its reply abandoned, and the same messages sent again; the
  branch continues from the second reply (the first becomes a sibling the gateway's
  default picker drops);
- **forks**: after the reply of a main-line turn that is not the last, a second branch of
  `fork_turns` turns continues from the same point, concurrently with the main line;
- **a resume**: once the main line and its forks are done, a branch of `resume_turns`
  turns continues from an earlier main-line turn (its history plus a new message).

Forks and resumes branch off the main line only (no fork inside a fork), which bounds a
session at `turns + forks * fork_turns + resume_turns` kept turns plus retries.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from sessiongate.loadgen.workload import (
    SyntheticOptions,
    SyntheticWorkload,
    TurnSpec,
    later_turn,
)


@dataclass(frozen=True, slots=True)
class TreeOptions:
    """Knobs of the tree workload (`--tree-*` flags; docs/bench.md "Tree sessions")."""

    retry_rate: float = 0.0  # per sent turn: probability that it is retried once
    fork_rate: float = 0.0  # per main-line turn but the last: probability of a fork after it
    fork_turns: int = 2  # turns of a forked branch
    resume_rate: float = 0.0  # per session: probability of a resume from an earlier turn
    resume_turns: int = 2  # turns of a resumed branch

    def check(self) -> None:
        problems = []
        for name in ("retry_rate", "fork_rate", "resume_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                problems.append(f"--tree-{name.replace('_', '-')} must be in [0, 1]")
        for name in ("fork_turns", "resume_turns"):
            if getattr(self, name) < 1:
                problems.append(f"--tree-{name.replace('_', '-')} must be >= 1")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass(slots=True)
class BranchSpec:
    """A run of turns continuing from one point of the session's tree."""

    label: str  # "main", "fork0", "fork1", "resume": part of the raw records' trace_id
    after: int | None  # the main-line turn whose kept reply it continues (None: the main line)
    turns: list[TurnSpec]
    retries: list[int] = field(default_factory=list)  # per turn: extra sends (0 or 1)

    def depth(self, index: int) -> int:
        """Tree depth (0 = a root node) of this branch's turn `index`."""
        return index if self.after is None else self.after + 1 + index


@dataclass(slots=True)
class TreeSessionSpec:
    id: str  # workload-local id ("s3")
    main: BranchSpec
    forks: list[BranchSpec] = field(default_factory=list)  # ordered by their `after`
    resume: BranchSpec | None = None

    def branches(self) -> list[BranchSpec]:
        return [self.main, *self.forks, *([self.resume] if self.resume else [])]

    def count(self) -> tuple[int, int]:
        """(sessions, planned sends including retries): the shape `SessionSpec` reports."""
        return 1, sum(len(b.turns) + sum(b.retries) for b in self.branches())


class TreeWorkload:
    """Tree sessions from a seed: session i is the same whatever the run's length."""

    def __init__(self, options: SyntheticOptions, tree: TreeOptions) -> None:
        tree.check()
        if options.child_prob > 0:
            raise ValueError("tree sessions have no sub-agents: drop --child-prob")
        self.tree = tree
        self.options = options
        self._lines = SyntheticWorkload(options)

    def __iter__(self) -> Iterator[TreeSessionSpec]:
        index = 0
        while True:
            yield self.root(index)
            index += 1

    def root(self, index: int) -> TreeSessionSpec:
        # The main line is the synthetic session of the same index, so a tree run and a
        # linear run of one seed send the same conversations (tree vs linear comparisons);
        # the branching decisions and extra turns come from a separate stream.
        line = self._lines.root(index)
        rng = random.Random(f"sessiongate-bench-tree|{self.options.seed}|{index}")
        t = self.tree
        main = BranchSpec("main", None, line.turns, self._retries(rng, len(line.turns)))
        last = len(line.turns) - 1
        forks: list[BranchSpec] = []
        for after in range(last):
            if t.fork_rate > 0 and rng.random() < t.fork_rate:
                forks.append(self._branch(rng, f"fork{len(forks)}", after, t.fork_turns))
        resume = None
        if last >= 1 and t.resume_rate > 0 and rng.random() < t.resume_rate:
            # From a turn before the last: resuming after the last turn is a continuation.
            resume = self._branch(rng, "resume", rng.randrange(last), t.resume_turns)
        return TreeSessionSpec(line.id, main, forks, resume)

    def _branch(self, rng: random.Random, label: str, after: int, turns: int) -> BranchSpec:
        specs = [later_turn(rng, self.options) for _ in range(turns)]
        return BranchSpec(label, after, specs, self._retries(rng, turns))

    def _retries(self, rng: random.Random, turns: int) -> list[int]:
        rate = self.tree.retry_rate
        return [int(rate > 0 and rng.random() < rate) for _ in range(turns)]
